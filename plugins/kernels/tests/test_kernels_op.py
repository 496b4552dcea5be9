"""llmcore::rms_norm: the C++ kernel against the module's formula, its schema, its
registration with PyTorch and the ExecuTorch runtime, and the plugin's hooks."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from llmcore.plugins import load_registry


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama family's RMSNorm (plugins/llama/llmcore_llama/model.py), as a function."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.type_as(x) * weight


@pytest.fixture(scope="module")
def ops(kernel_library):
    from llmcore_kernels import ops

    return ops


# dtype -> largest |difference| allowed against the reference (the kernel sums squares in
# another order; 16-bit outputs then round identically or one ulp apart).
TOLERANCE = {torch.float32: 2e-6, torch.float64: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", [(576,), (1, 1, 576), (2, 7, 64), (3, 13), (4, 1), (1, 5, 8)])
def test_matches_the_module_formula(ops, dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    w = (torch.randn(shape[-1], generator=g)).to(dtype)
    got = torch.ops.llmcore.rms_norm(x, w, 1e-5)
    want = reference(x, w, 1e-5)
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = max(1.0, want.float().abs().max().item())
    assert (got.float() - want.float()).abs().max().item() <= TOLERANCE[dtype] * scale


def test_out_variant_and_non_contiguous_input(ops):
    x = torch.randn(5, 3, 32).transpose(0, 1)  # not contiguous
    w = torch.randn(32)
    out = torch.empty(0)
    result = torch.ops.llmcore.rms_norm.out(x, w, 1e-6, out=out)
    assert result.data_ptr() == out.data_ptr() and out.shape == x.shape
    torch.testing.assert_close(out, reference(x, w, 1e-6), atol=2e-6, rtol=1e-5)


def test_large_eps_and_zero_rows(ops):
    x = torch.zeros(2, 16)
    w = torch.ones(16)
    assert torch.equal(torch.ops.llmcore.rms_norm(x, w, 0.5), torch.zeros(2, 16))
    assert torch.ops.llmcore.rms_norm(torch.zeros(0, 16), w, 1e-5).shape == (0, 16)


@pytest.mark.parametrize(
    "x, w, eps, message",
    [
        (torch.randn(2, 8), torch.randn(7), 1e-5, "weight must be 1-D with the input's last size"),
        (torch.randn(2, 8), torch.randn(8, 1), 1e-5, "weight must be 1-D"),
        (torch.randn(2, 8), torch.randn(8, dtype=torch.float64), 1e-5, "must have one dtype"),
        (torch.randint(0, 5, (2, 8)), torch.randint(0, 5, (8,)), 1e-5, "unsupported dtype"),
        (torch.randn(2, 8), torch.randn(8), -1.0, "eps must be finite"),
    ],
)
def test_bad_arguments_are_refused_with_a_message(ops, x, w, eps, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.llmcore.rms_norm(x, w, eps)


def test_schema_has_functional_and_out_variants(ops):
    functional = torch.ops.llmcore.rms_norm.default._schema
    out = torch.ops.llmcore.rms_norm.out._schema
    assert str(functional) == "llmcore::rms_norm(Tensor input, Tensor weight, float eps) -> Tensor"
    assert str(out) == "llmcore::rms_norm.out(Tensor input, Tensor weight, float eps, *, Tensor(a!) out) -> Tensor(a!)"


def test_export_sees_the_op_with_a_dynamic_length(ops):
    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(16))

        def forward(self, x):
            return torch.ops.llmcore.rms_norm(x, self.weight, 1e-5)

    model = Norm()
    seq = torch.export.Dim("seq", min=1, max=64)
    ep = torch.export.export(model, (torch.randn(1, 4, 16),), dynamic_shapes=({1: seq},))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.llmcore.rms_norm.default in targets
    x = torch.randn(1, 9, 16)  # another length than the example's
    torch.testing.assert_close(ep.module()(x), model(x))


def test_the_executorch_runtime_has_the_kernel(ops):
    from executorch.extension.pybindings import portable_lib

    names = portable_lib._get_operator_names()
    from llmcore_kernels import OPS

    assert set(OPS) <= set(names)


def test_hooks_declare_the_library_the_transform_and_the_recipe():
    registry = load_registry()
    provided = registry.get("runtime_libraries", "llmcore_kernels", stage="test")
    record = provided.record
    assert provided.plugin.distribution == "llmcore-kernels"
    assert record.ops == ("llmcore::rms_norm.out", "llmcore::int4_mlp.out", "llmcore::int4_norm_qkv_rope.out",
                          "llmcore::int4_norm_qkv_norm_rope.out", "llmcore::int4_linear_add.out", "llmcore::int4_norm_mlp_add.out", "llmcore::int4_linear.out",
                          "llmcore::int4_linear_norm_add.out", "llmcore::int4_norm_glu_add.out",
                          "llmcore::int4_linear_bias_add.out", "llmcore::int4_layer_norm_linear.out",
                          "llmcore::int4_layer_norm_ffn_add.out", "llmcore::q6_k_embedding.out")
    assert record.python_module == "llmcore_kernels.ops"
    transform = registry.get("transforms", "fused-rmsnorm", stage="test").record
    assert not transform.automatic
    # 8da4w-mlp, 8da4w-layers: llmcore-xnnpack's 8da4w record (options, calibration, backend),
    # each with its own rewrite
    base = registry.get("quantizers", "8da4w", stage="test").record
    for name in ("8da4w-mlp", "8da4w-layers"):
        recipe = registry.get("quantizers", name, stage="test").record
        assert recipe.options == base.options and recipe.calibrated and recipe.backends == ("xnnpack",)
        assert recipe.source_quantize is not base.source_quantize
    # 8da8w-layers: 8da8w's record with the outlier split off by default (the kernels take one row)
    base = registry.get("quantizers", "8da8w", stage="test").record
    recipe = registry.get("quantizers", "8da8w-layers", stage="test").record
    assert base.options["outlier_split"][1] is True and recipe.options["outlier_split"][1] is False
    assert {k: v for k, v in recipe.options.items() if k != "outlier_split"} == {
        k: v for k, v in base.options.items() if k != "outlier_split"}
    assert recipe.calibrated and recipe.backends == ("xnnpack",)


def _needed(path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def test_the_native_libraries_link_the_wheels_runtime(kernel_library):
    import sysconfig

    from llmcore_kernels import library

    if shutil.which("readelf") is None:
        pytest.skip("readelf is not available")
    # The kernels must register into the runtime the bindings use: the library links the
    # wheel's libexecutorch.so (by soname), which the Python extension `_C` links too, and
    # nothing of Python or PyTorch (so a runner without them can load it).
    needed = _needed(kernel_library / library.RUNTIME_LIBRARY)
    assert "libexecutorch.so" in needed
    assert not [n for n in needed if n.startswith(("libtorch", "libc10", "libpython", "_C", "_portable_lib"))], needed
    pybindings = Path(sysconfig.get_paths()["purelib"]) / "executorch" / "extension" / "pybindings"
    extension = next(pybindings.glob("_C*.so"))
    assert "libexecutorch.so" in _needed(extension)
    assert (kernel_library / library.AOT_LIBRARY).is_file()
    # One pool of kernel threads for the process: the kernels and the runtime's attention
    # kernels link the same library, found next to them.
    from llmcore.runtime import libraries

    for name in (library.RUNTIME_LIBRARY, libraries.LLM_OPS_LIBRARY):
        assert "libllmcore_threads.so" in _needed(kernel_library / name), name
    assert (kernel_library / "libllmcore_threads.so").is_file()
