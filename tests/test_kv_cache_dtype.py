"""``--kv-cache-dtype``: a KV cache of 16-bit floats or int8, in eager PyTorch, in the program
(Python runtime: ExecuTorch's kernels) and in the C++ runner (llmcore's kernels,
runtime/kernels/llm_ops.cpp), and the export's refusals.

Authorities: the fp32 plain-PyTorch cache (the model's own arithmetic) for the cached
attention modules; the export's parity check (the program against its eager model with the
same cache); the fp32-cache program for how far a narrower cache moves the logits; the
Python runtime for every token the C++ runner picks, on each instruction-set build of its
attention kernel (``LLMCORE_KERNELS_MAX_ISA=portable`` forces the baseline one).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from clitools import run_cli

from llmcore import kv_cache
from llmcore.builtins import runtime_attention
from llmcore.runtime import libraries
from llmcore.builtins.kv_cache import CustomOpKVAttention, StaticKVAttention, caches_in_fp32, plain_attention

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "build" / "llmcore_runner"
PROMPT = "Once upon a time, there was a little robot who"

# ||y - y_fp32|| / ||y_fp32|| of one attention call on random data (each near a third of
# the bound: fp16 3e-4, bf16 2.6e-3, int8 4e-3 to 8e-3)
ATTENTION_ERROR = {"fp16": 2e-3, "bf16": 1e-2, "int8": 2.5e-2}


@pytest.mark.parametrize("cache_dtype", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("window,slots", [(None, None), (6, None), (6, 9)])
def test_a_narrow_cache_attends_as_the_fp32_one_does(cache_dtype, window, slots):
    """Prompt, decode steps and a chunk, past a sliding window and round a ring buffer:
    each call close to the fp32 plain-PyTorch cache, and the buffers of the type asked for."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, capacity = 4, 2, 16, 32
    cached = CustomOpKVAttention(heads, kv_heads, head_dim, capacity, window, cache_dtype=cache_dtype, slots=slots)
    reference = StaticKVAttention(heads, kv_heads, head_dim, capacity, window, slots=slots)
    assert cached.cache_dtype == cache_dtype
    assert cached.k_cache.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}[cache_dtype]
    for pos, length in [(0, 4), (4, 1), (5, 1), (6, 4), (10, 1), (11, 3), (14, 1)]:
        q = torch.randn(1, length, heads, head_dim)
        k, v = torch.randn(1, length, kv_heads, head_dim), torch.randn(1, length, kv_heads, head_dim)
        want = reference(q, k, v, torch.tensor([pos]))
        got = cached(q, k, v, torch.tensor([pos]))
        error = float((got - want).norm() / want.norm())
        assert error < ATTENTION_ERROR[cache_dtype], (pos, error)
        assert got.dtype == torch.float32


def test_calibration_sees_fp32_caches_and_gets_its_own_back():
    attention = CustomOpKVAttention(4, 2, 16, 32, cache_dtype="int8")
    kept = dict(attention.named_buffers())
    with caches_in_fp32(attention):
        assert attention.k_cache.dtype == torch.float32 and not hasattr(attention, "k_scales")
        attention(torch.randn(1, 3, 4, 16), torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 16), torch.tensor([0]))
    assert attention.cache_dtype == "int8"
    assert {n: b.data_ptr() for n, b in attention.named_buffers()} == {n: b.data_ptr() for n, b in kept.items()}
    assert all(not b.any() for b in attention.buffers())  # what ran inside wrote the fp32 ones


def test_the_cache_bytes_are_what_the_records_say():
    for name in kv_cache.CACHE_DTYPES:
        attention = CustomOpKVAttention(4, 2, 16, 32, cache_dtype=name)
        held = sum(b.numel() * b.element_size() for b in attention.buffers())
        assert held == kv_cache.cache_bytes(32, 2, 16, name)
    assert kv_cache.cache_bytes(32, 2, 64, "int8") / kv_cache.cache_bytes(32, 2, 64, "fp32") < 0.27


def _export(tmp_path: Path, cache_dtype: str, *extra: str) -> subprocess.CompletedProcess:
    out = tmp_path / f"tiny-{cache_dtype}.pte"
    return run_cli("export", "--model", "llama", "--config", "tiny", "--quantize", "8da4w", "--kv-cache-dtype",
                   cache_dtype, "--max-seq-len", "96", "--prompt", PROMPT, "-o", str(out), *extra, cwd=ROOT)


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """A tiny random Llama, 8da4w on the CPU's default backends, with each cache type."""
    folder = tmp_path_factory.mktemp("kv_dtype")
    made = {}
    for name in ("fp32", "bf16", "fp16", "int8"):
        done = _export(folder, name)
        assert done.returncode == 0, done.stderr[-3000:]
        made[name] = (folder / f"tiny-{name}.pte", done.stdout)
    return made


def _logits(pte: Path, ids: list[int]) -> torch.Tensor:
    from llmcore.runtime import Program

    program = Program.load(pte)
    rows = [program.logits(ids[:8], 0)]  # a prompt, then decode steps
    rows += [program.logits([t], i) for i, t in enumerate(ids[8:], start=8)]
    return torch.stack([torch.as_tensor(r).reshape(-1) for r in rows])


@pytest.mark.parametrize("cache_dtype", ["bf16", "fp16", "int8"])
def test_the_program_keeps_the_cache_it_was_asked_for(programs, cache_dtype):
    """The export says what the cache holds and costs; its parity check (program against
    the eager model with that cache) agrees on every top-1; next to the fp32-cache program
    the logits move little and the greedy choices stay."""
    pte, stdout = programs[cache_dtype]
    report = json.loads(pte.with_suffix(".report.json").read_text())
    fp32_report = json.loads(programs["fp32"][0].with_suffix(".report.json").read_text())
    cache, fp32_cache = report["model"]["kv_cache"], fp32_report["model"]["kv_cache"]
    assert cache["dtype"] == cache_dtype and cache["layers"] == fp32_cache["layers"]
    ratio = cache["bytes"] / fp32_cache["bytes"]
    assert ratio == pytest.approx(0.5 if cache_dtype != "int8" else (16 + 5) / 64, rel=1e-6)
    assert f"KV cache: {cache_dtype}," in stdout
    assert report["parity"]["top1_agreement"] == 1.0
    if cache_dtype == "int8" and runtime_attention.kernel_built():
        # the rounding is one llmcore::quantize_rows call for each of k, v and q, not
        # quantized_decomposed's ops decomposed into a score of portable ones
        calls = libraries.program_operators(pte.read_bytes())
        assert "llmcore::quantize_rows.out" in calls
        rounding = ("choose_qparams", "quantize_per_token", "amin", "amax", "round")
        assert not [op for op in calls if any(name in op for name in rounding)], calls
    ids = list(range(3, 40))
    narrow, wide = _logits(pte, ids), _logits(programs["fp32"][0], ids)
    error = float((narrow - wide).norm() / wide.norm())
    assert error < 0.05, error
    assert (narrow.argmax(-1) == wide.argmax(-1)).float().mean() >= 0.9


@pytest.mark.skipif(not RUNNER.is_file(), reason="build the C++ runner with `make runner`")
@pytest.mark.parametrize("isa", ["native", "portable"])
@pytest.mark.parametrize("cache_dtype", ["bf16", "fp16", "int8"])
def test_the_cpp_runner_picks_pythons_tokens(programs, cache_dtype, isa, monkeypatch):
    """llmcore's own attention kernels over each cache type, in both builds, choose every
    token the Python runtime (ExecuTorch's kernels) would on the runner's prefix."""
    from llmcore.runtime.agreement import check

    if isa == "portable":
        monkeypatch.setenv("LLMCORE_KERNELS_MAX_ISA", "portable")
    (agreement,) = check(programs[cache_dtype][0], RUNNER, PROMPT, 24)
    assert agreement.agrees, agreement.line()
    assert len(agreement.runner.ids) > 0


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--kv-cache-dtype", "fp8"], "unknown KV cache dtype 'fp8'"),
        (["--kv-cache-dtype", "int8", "--skip-transforms", "kv-cache"], "--kv-cache-dtype int8 needs a KV cache"),
        (["--kv-cache-dtype", "int8", "--transforms", "kv-cache-static"], "needs the kv-cache transform"),
        (["--kv-cache-dtype", "bf16", "--plugins", "coreml"], "swapped"),
    ],
)
def test_a_cache_type_the_export_cannot_keep_is_refused_in_one_line(tmp_path, extra, message):
    out = tmp_path / "x.pte"
    done = run_cli("export", "--model", "llama", "--config", "tiny", "--max-seq-len", "32", "-o", str(out), *extra,
                   cwd=ROOT)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("llmcore: error")]
    assert len(lines) == 1 and message in lines[0], done.stderr[-2000:]
    assert not out.exists()
