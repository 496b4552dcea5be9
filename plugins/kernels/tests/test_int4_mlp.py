"""llmcore::int4_mlp and the 8da4w-mlp recipe: the kernel against the three int4 linears it
replaces (each rounding its input per token, as the 8da4w programs do), the packed layout,
which MLPs the rewrite takes and refuses, a program that runs in Python and llmcore_runner
alike, and the GEMM probe's own check of the kernel against a double-precision sum."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmcore.errors import LlmcoreError

PROMPT = "Hello there, world"


def int4_linear(out_features: int, in_features: int, block: int = 32, seed: int = 0, **kwargs):
    from llmcore_xnnpack import qlinear

    g = torch.Generator().manual_seed(seed)
    q, scales = qlinear.int4_blocks(torch.randn(out_features, in_features, generator=g) * 0.05, block)
    return qlinear.BlockInt4Linear(q, scales, **kwargs)


class SwiGLU(nn.Module):
    """Llama's gated MLP under its names: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int, activation=F.silu, **kwargs):
        super().__init__()
        self.w1 = int4_linear(hidden, dim, seed=1, **kwargs)
        self.w3 = int4_linear(hidden, dim, seed=2, **kwargs)
        self.w2 = int4_linear(dim, hidden, seed=3, **kwargs)
        self.activation = activation

    def forward(self, x):
        return self.w2(self.activation(self.w1(x)) * self.w3(x))


@pytest.fixture(scope="module")
def ops(kernel_library):
    from llmcore_kernels import ops

    return ops


# blocks of 32 per row: 3 and 5 (groups 2+1 and 4+1), 15 and 9 (8+4+2+1 and 8+1)
@pytest.mark.parametrize("dim,hidden", [(96, 160), (480, 288)])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_kernel_computes_what_the_three_linears_compute(ops, rows, dim, hidden):
    from llmcore_kernels.mlp import FusedInt4MLP, computing_as_the_kernels

    mlp = SwiGLU(dim, hidden)
    fused = FusedInt4MLP(mlp.w1, mlp.w3, mlp.w2)
    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(rows)) * 2
    x[0, 0] = 30.0  # an outlier sets its block's int8 scale
    with torch.no_grad(), computing_as_the_kernels(mlp):
        want, got = mlp(x), fused(x)
    # The same integers, rounded the same way; a value within float error of an int8 rounding
    # boundary of silu(gate) * up may land on the other side. Measured: ~3e-7 for one row,
    # up to ~2e-4 at 64.
    error = float((got - want).norm() / want.norm())
    assert error < 1e-3
    # batch dimensions are kept, and the program's .out variant gives the same numbers
    out = torch.empty(0)
    torch.ops.llmcore.int4_mlp.out(x[None], fused.gate_up, fused.gate_up_scales, fused.gate_up_sums, fused.down,
                                   fused.down_scales, fused.down_sums, out=out)
    assert out.shape == (1, rows, dim)
    torch.testing.assert_close(out[0], got, rtol=0, atol=0)


def test_weights_packed_by_an_older_layout_are_refused(ops):
    from llmcore_kernels.mlp import FusedInt4MLP

    mlp = SwiGLU(96, 160)
    fused = FusedInt4MLP(mlp.w1, mlp.w3, mlp.w2)
    old_shape = fused.gate_up.reshape(fused.gate_up.shape[0], -1)  # [rows, in/2]: before the arranged order
    with pytest.raises(RuntimeError, match=r"gate_up: packed weights must be .*\[rows, in/32, 16\].*export it again"):
        torch.ops.llmcore.int4_mlp(torch.randn(1, 96), old_shape, fused.gate_up_scales, fused.gate_up_sums,
                                   fused.down, fused.down_scales, fused.down_sums)


def unpack_documented_layout(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The integers of packed rows, read as csrc/int4_gemm.h describes the layout (written
    from the description, not from the kernel): groups of 8, 4, 2, 1 blocks; a group of G
    is G steps of 32 values, step s's 4-byte lane L holding values 4 (s p + l) .. + 3 of
    block L // p (p = 8 // G, l = L % p); two steps per 32 bytes (low nibbles, then high),
    a group of one block in 16 bytes (bytes 0-15 low, 16-31 high)."""
    rows = packed.shape[0]
    packed = packed.reshape(rows, k // 2)
    out = torch.empty(rows, k, dtype=torch.int16)
    u = packed.to(torch.int16)
    blocks, g = k // 32, 0
    for size in (8, 4, 2, 1):
        while blocks - g >= size:
            chunk = 16 if size == 1 else 32  # bytes holding two halves of values
            raw = u[:, g * 16 : (g + size) * 16].reshape(rows, -1, chunk)
            steps = torch.cat([raw & 0x0F, raw >> 4], dim=2).reshape(rows, size, 32)  # [rows, step, byte]
            per = 8 // size
            for s in range(size):
                for lane in range(8):
                    block, part = g + lane // per, s * per + lane % per
                    out[:, block * 32 + 4 * part : block * 32 + 4 * part + 4] = steps[:, s, 4 * lane : 4 * lane + 4]
            g += size
    return out - 8


def test_the_packed_layout(ops):
    from llmcore_kernels.mlp import pack
    from llmcore_xnnpack.qlinear import pack_nibbles

    g = torch.Generator().manual_seed(0)
    for cols in (64, 224, 480, 576):  # groups 2; 4+2+1; 8+4+2+1; 8+8+2
        q = torch.randint(-8, 8, (3, cols), generator=g, dtype=torch.int8)
        scales = torch.rand(3, cols // 32, generator=g).to(torch.bfloat16).float()
        packed, bf16, sums = pack(q, scales)
        assert packed.dtype == torch.uint8 and packed.shape == (3, cols // 32, 16) and bf16.dtype == torch.bfloat16
        assert torch.equal(unpack_documented_layout(packed, cols).to(torch.int8), q), cols
        torch.testing.assert_close(sums, (q.float().view(3, -1, 32) * scales[..., None]).sum((1, 2)))
        # the same integers held two to a byte (a GGUF's layers until the kernels take them)
        from_nibbles = pack(pack_nibbles(q), scales)
        assert all(torch.equal(a, b) for a, b in zip(from_nibbles, (packed, bf16, sums))), cols
    many = torch.randint(-8, 8, (300, 96), generator=g, dtype=torch.int8)  # rows split between threads
    assert torch.equal(torch.ops.llmcore.int4_pack(pack_nibbles(many)), torch.ops.llmcore.int4_pack(many))
    assert torch.equal(unpack_documented_layout(torch.ops.llmcore.int4_pack(many), 96).to(torch.int8), many)
    with pytest.raises(ValueError, match="bfloat16"):
        pack(q, scales + 1e-4)
    with pytest.raises(RuntimeError, match=r"outside \[-8, 7\]"):
        torch.ops.llmcore.int4_pack(torch.full((1, 32), 9, dtype=torch.int8))


def test_the_rewrite_takes_swiglu_and_leaves_other_mlps(ops):
    from llmcore_kernels import mlp

    model = nn.ModuleDict({"swiglu": SwiGLU(64, 96), "geglu": SwiGLU(64, 96, activation=F.gelu)})
    swapped, kept = mlp.swap_mlps(model)
    assert swapped == 1 and isinstance(model["swiglu"], mlp.FusedInt4MLP)
    assert len(kept) == 1 and kept[0].startswith("geglu: differs from the kernel")
    with pytest.raises(LlmcoreError, match="8da4w-mlp: 1 MLP"):
        mlp.apply(nn.ModuleDict({"a": SwiGLU(64, 96), "b": SwiGLU(64, 96, activation=F.gelu)}))


@pytest.mark.parametrize(
    "kwargs, reason",
    [({"block": 64}, "blocks are 64 wide"), ({"outlier_split": True}, "split outliers")],
)
def test_the_rewrite_refuses_what_the_kernel_cannot_run(ops, kwargs, reason):
    from llmcore_kernels import mlp

    with pytest.raises(LlmcoreError, match=reason) as caught:
        mlp.apply(nn.Sequential(SwiGLU(64, 128, **kwargs)))
    assert "--quantize 8da4w" in caught.value.fix


@pytest.mark.parametrize(
    "recipe, option, value",
    [("8da4w-mlp", "group_size", 64), ("8da4w-mlp", "asymmetric", True), ("8da4w-mlp", "outlier_split", True),
     ("8da4w-layers", "group_size", 64), ("8da4w-layers", "outlier_split", True)],  # its operators take offsets
)
def test_the_recipe_refuses_options_the_kernel_cannot_run(recipe, option, value):
    from llmcore_kernels import llmcore_quantizers

    quantize = next(r for r in llmcore_quantizers() if r.name == recipe).source_quantize
    options = {"group_size": 32, "asymmetric": False, "outlier_split": False, option: value}
    with pytest.raises(LlmcoreError, match=f"{recipe}: {option}={value}"):
        quantize(nn.Linear(4, 4), options, None)


@pytest.fixture(scope="module")
def mlp_export(kernel_library, tmp_path_factory):
    """The tiny random Llama exported for XNNPACK with --quantize 8da4w-mlp."""
    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    out = tmp_path_factory.mktemp("mlp") / "tiny.pte"
    options = ExportOptions(model="llama", config="tiny", plugins=["xnnpack"], quantize="8da4w-mlp",
                            output=str(out), quiet=True)
    return export(options, load_registry())


def test_the_program_calls_the_kernel_and_matches_its_eager_model(mlp_export):
    from llmcore.runtime import libraries

    ops = libraries.program_operators(mlp_export.pte.read_bytes())
    assert "llmcore::int4_mlp.out" in ops
    assert mlp_export.report["quantization"]["recipe"] == "8da4w-mlp"
    parity = mlp_export.report["parity"]
    # the export's own check: the program against the quantized eager model (which runs the
    # same kernel through its PyTorch registration)
    assert parity["top1_agreement"] == 1.0 and parity["max_abs_diff"] < 0.05


def test_llmcore_run_and_llmcore_runner_agree(mlp_export, runner, llmcore_cli):
    import json

    result = llmcore_cli("run", str(mlp_export.pte), "--prompt", PROMPT, "--max-new-tokens", "16", "--json")
    assert result.returncode == 0, result.stderr
    python_ids = json.loads(result.stdout)["generated_ids"]
    out = subprocess.run(
        [str(runner), str(mlp_export.pte), "--prompt", PROMPT, "--max-new-tokens", "16", "--temperature", "0",
         "--print-ids"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("ids:"))
    assert [int(i) for i in line.split()[1:]] == python_ids


def test_the_gemm_probe_checks_the_kernel(tmp_path):
    """benchmarks/int4_gemm_probe: each code path this CPU can run (AVX-512 VNNI, AVX-VNNI,
    AVX2, portable) against a double-precision sum."""
    root = Path(__file__).resolve().parents[3]
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    probe = tmp_path / "int4_probe"
    subprocess.run(
        [compiler, "-O2", "-std=c++17", "-ffp-contract=off", "-pthread", "-Wno-psabi",
         f"-I{root / 'plugins/kernels/csrc'}", f"-I{root / 'runtime/kernels'}",  # cpu_isa.h: the runtime's
         str(root / "benchmarks/int4_gemm_probe/probe.cpp"),
         str(root / "plugins/kernels/csrc/int4_gemm.cpp"), "-o", str(probe)],
        check=True, timeout=300,
    )
    from llmcore.testing.isa_view import proc_flags

    flags = proc_flags()
    # the best code here, then capped (LLMCORE_KERNELS_MAX_ISA), and the code each cap runs
    caps = {"": None, "avx_vnni": "AVX-VNNI" if "avx_vnni" in flags and "avx2" in flags else None,
            "avx2": "AVX2" if {"avx2", "fma"} <= flags else None, "portable": "portable"}
    for cap, code in caps.items():
        env = {**os.environ, "LLMCORE_KERNELS_MAX_ISA": cap}
        out = subprocess.run([str(probe), "check"], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.startswith("ok"), out.stdout
        if code:
            assert out.stdout.startswith(f"ok (the {code} "), out.stdout


def test_gguf_layers_refuses_outlier_split():
    from llmcore_kernels import llmcore_quantizers

    recipe = next(r for r in llmcore_quantizers() if r.name == "gguf-layers")
    assert recipe.for_quantized_checkpoints and not recipe.checkpoint_default  # gguf stays the default
    with pytest.raises(LlmcoreError, match="gguf-layers: outlier_split=True"):
        recipe.source_quantize(nn.Linear(4, 4), {"outlier_split": True})
