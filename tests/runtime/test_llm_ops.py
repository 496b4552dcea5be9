"""The runner's own llama::update_cache, llama::update_cache_with_indices and
llama::custom_sdpa kernels (runtime/kernels/llm_ops.cpp).

* Kernel level: build/llmcore_llm_ops_check runs them through the ExecuTorch operator
  registry on raw buffers; the results are compared with attention written out in torch
  (float64) and with ExecuTorch's own kernels (torch.ops.llama, from
  libcustom_ops_aot_lib.so), for grouped-query attention, prefill chunks at an offset,
  decode steps, non-causal calls, explicit scales, odd head sizes and additive masks over a
  ring buffer (sliding windows); the ring buffer's indexed writes; refused arguments
  must fail with a clear error.
* Program level: the runner's greedy tokens on KV-cache programs against `llmcore run
  --json` (ExecuTorch's kernels in Python), and, on a grouped-query program with an
  explicit scale and chunked prefill, against the Python reference loop.
"""

from __future__ import annotations

import json
import math
import shutil
import os
import subprocess

import pytest
import torch
from torch import nn

from test_runner import BUILD, binaries, built_tool, parse_ids, programs, run_runner  # noqa: F401

CHECK = BUILD / "llmcore_llm_ops_check"


@pytest.fixture(scope="session")
def ops_check(binaries):  # noqa: F811
    return built_tool(CHECK.name)


def reference_sdpa(q, k, v, start, causal, scale):
    """Attention over cache rows [0, start + S), [B, S, H, D] layout, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    b, s, h, d = q.shape
    n_rep = h // k.shape[2]
    n = start + s
    keys = k[:, :n].repeat_interleave(n_rep, dim=2).transpose(1, 2)
    values = v[:, :n].repeat_interleave(n_rep, dim=2).transpose(1, 2)
    scores = q.transpose(1, 2) @ keys.transpose(-1, -2) * (1.0 / math.sqrt(d) if scale is None else scale)
    if causal:
        visible = torch.arange(n)[None, :] <= (torch.arange(s)[:, None] + start)
        scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ values).transpose(1, 2).float()


def run_check(tool, folder, command, env=None, **params):
    args = [str(tool), command, str(folder)] + [f"{k}={'none' if v is None else int(v) if isinstance(v, bool) else v}"
                                                for k, v in params.items()]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)


def sdpa_on_random_inputs(ops_check, tmp_path, seed, batch, q_len, heads, head_dim, kv_len, kv_heads, start,
                          isa=None, **params):
    """Random q, k, v and the kernel's output on them (run_check's "sdpa"). The cache rows
    past the attended range are NaN: they must not matter."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_len, heads, head_dim, generator=g) * 2
    k = torch.randn(batch, kv_len, kv_heads, head_dim, generator=g)
    v = torch.randn(batch, kv_len, kv_heads, head_dim, generator=g)
    k[:, start + q_len:] = float("nan")
    v[:, start + q_len:] = float("nan")
    for name, t in (("q", q), ("k", k), ("v", v)):
        (tmp_path / f"{name}.bin").write_bytes(t.contiguous().numpy().tobytes())
    env = None if isa is None else os.environ | {"LLMCORE_KERNELS_MAX_ISA": isa}
    r = run_check(ops_check, tmp_path, "sdpa", env=env, batch=batch, q_len=q_len, heads=heads, head_dim=head_dim,
                  kv_len=kv_len, kv_heads=kv_heads, start=start, **params)
    assert r.returncode == 0, r.stderr
    if isa == "portable":  # the switch took effect: the baseline code ran
        assert "isa=portable" in r.stdout, r.stdout
    if params.get("pool") and params.get("threads", 2) > 1:  # the call found the kernels' threads awake
        assert "kernel_threads_awake=1" in r.stdout, r.stdout
    got = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32).view(q.shape)
    return q, k, v, got


SDPA_CASES = [
    # batch, q_len, heads, head_dim, kv_len, kv_heads, start, causal, scale
    pytest.param(1, 1, 9, 64, 1024, 3, 700, True, None, id="decode-gqa-smollm2-shape"),
    # 512 keys and more: a decode step's item takes every kv head (attend's whole_heads)
    pytest.param(1, 1, 32, 64, 1100, 8, 1000, True, None, id="decode-llama-1b-shape-every-head-an-item"),
    pytest.param(2, 2, 6, 24, 700, 2, 600, True, None, id="two-rows-every-head-an-item-batch2"),
    pytest.param(1, 3, 5, 16, 600, 5, 560, True, 0.5, id="three-rows-mha-every-head-an-item"),
    pytest.param(1, 1, 4, 16, 64, 4, 0, True, None, id="decode-first-position"),
    pytest.param(1, 37, 8, 32, 128, 2, 20, True, None, id="prefill-chunk-gqa-at-offset"),
    pytest.param(1, 16, 4, 16, 16, 1, 0, True, None, id="prefill-fills-cache-mqa"),
    pytest.param(2, 5, 6, 24, 40, 3, 7, False, 0.3, id="batch2-noncausal-scale"),
    pytest.param(1, 3, 4, 13, 20, 2, 4, True, 0.5, id="odd-head-dim"),
    pytest.param(1, 9, 2, 8, 12, 2, 3, True, 2.0, id="large-scale"),
]


# The attention's two compilations (cpu_isa.h): this CPU's best, and the baseline code an x86
# without AVX2 runs, forced with LLMCORE_KERNELS_MAX_ISA=portable.
@pytest.mark.parametrize("isa", [None, "portable"], ids=["best", "portable"])
@pytest.mark.parametrize("batch,q_len,heads,head_dim,kv_len,kv_heads,start,causal,scale", SDPA_CASES)
def test_custom_sdpa_matches_torch(ops_check, tmp_path, batch, q_len, heads, head_dim, kv_len, kv_heads, start,
                                   causal, scale, isa):
    q, k, v, got = sdpa_on_random_inputs(ops_check, tmp_path, q_len * 1000 + heads, batch, q_len, heads, head_dim,
                                         kv_len, kv_heads, start, isa=isa, causal=causal, scale=scale)
    want = reference_sdpa(q, k, v, start, causal, scale)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)

    # ExecuTorch's own kernel (what `llmcore run` uses) agrees too.
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401

    theirs = torch.ops.llama.custom_sdpa(q, torch.nan_to_num(k), torch.nan_to_num(v), start, None, 0.0, causal, scale)
    torch.testing.assert_close(got, theirs, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("skew", [0, 16, 4])
def test_custom_sdpa_on_rows_off_cache_lines_matches_torch(ops_check, tmp_path, skew):
    """A prompt's rows 16 bytes past a cache line (where the Python bindings put planned
    memory) or 4 (never 32-byte aligned) give the output of rows on a cache line, bit for bit:
    the kernel's loads assume no alignment."""
    outputs = []
    for placement in (0, skew):
        q, k, v, got = sdpa_on_random_inputs(ops_check, tmp_path, 5, 1, 64, 9, 64, 128, 3, 20, causal=True,
                                             skew=placement)
        torch.testing.assert_close(got, reference_sdpa(q, k, v, 20, True, None), rtol=2e-5, atol=2e-6)
        outputs.append(got)
    assert torch.equal(outputs[0], outputs[1])


def test_custom_sdpa_timed_cold_computes_what_it_computes_warm(ops_check, tmp_path):
    """cold=1 (the timing of docs/performance.md: 64 MiB read before each call, so that the
    cache rows come from memory) runs the same kernel on the same rows: the same output."""
    outputs = []
    for cold in (0, 1):
        q, k, v, got = sdpa_on_random_inputs(ops_check, tmp_path, 11, 1, 1, 9, 64, 1024, 3, 500, causal=True,
                                             repeat=3, cold=cold)
        outputs.append(got)
    torch.testing.assert_close(outputs[1], reference_sdpa(q, k, v, 500, True, None), rtol=2e-5, atol=2e-6)
    assert torch.equal(outputs[0], outputs[1])


THREADED_CASES = [
    # batch, q_len, heads, head_dim, kv_len, kv_heads, start
    pytest.param(1, 1, 9, 64, 1024, 3, 300, id="decode-3-kv-heads"),
    pytest.param(1, 1, 9, 64, 1024, 3, 20, id="decode-too-short-to-slice"),
    pytest.param(1, 1, 8, 16, 256, 1, 250, id="decode-mqa"),
    pytest.param(2, 3, 6, 24, 200, 3, 90, id="batch2-short-chunk"),
    pytest.param(1, 5, 4, 13, 160, 2, 100, id="odd-head-dim-causal-rows"),
    pytest.param(1, 1, 32, 64, 1100, 8, 1000, id="decode-every-head-an-item"),
    pytest.param(1, 2, 6, 24, 700, 2, 600, id="two-rows-every-head-an-item"),
]


@pytest.mark.parametrize("pool", [0, 1])
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("batch,q_len,heads,head_dim,kv_len,kv_heads,start", THREADED_CASES)
def test_custom_sdpa_split_across_threads_matches_torch(ops_check, tmp_path, pool, threads, batch, q_len, heads,
                                                        head_dim, kv_len, kv_heads, start):
    """A call with fewer (batch, kv head, row block) items than fill the threads evenly
    slices its keys and merges the slices' softmax parts; the result must not depend on
    how many threads there are, nor on which pool runs them (pool=1: the kernels' own
    threads, awake; else ExecuTorch's)."""
    q, k, v, got = sdpa_on_random_inputs(ops_check, tmp_path, start + heads, batch, q_len, heads, head_dim, kv_len,
                                         kv_heads, start, causal=True, threads=threads, pool=pool)
    torch.testing.assert_close(got, reference_sdpa(q, k, v, start, True, None), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_custom_sdpa_with_a_slice_of_masked_keys(ops_check, tmp_path, threads):
    """A decode step of a sliding layer whose window covers only the cache's last rows:
    sliced across threads, the first slices see no key at all (every score -inf) and must
    add nothing, neither NaN nor weight."""
    heads, kv_heads, head_dim, rows = 4, 1, 16, 192
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 1, heads, head_dim, generator=g) * 2
    k = torch.randn(1, rows, kv_heads, head_dim, generator=g)
    v = torch.randn(1, rows, kv_heads, head_dim, generator=g)
    mask = torch.full((1, rows), float("-inf"))
    mask[0, rows - 10:] = 0.0
    for name, t in (("q", q), ("k", k), ("v", v), ("mask", mask)):
        (tmp_path / f"{name}.bin").write_bytes(t.contiguous().numpy().tobytes())
    r = run_check(ops_check, tmp_path, "sdpa", batch=1, q_len=1, heads=heads, head_dim=head_dim, kv_len=rows,
                  kv_heads=kv_heads, start=0, causal=False, mask=1, threads=threads)
    assert r.returncode == 0, r.stderr
    got = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32).view(q.shape)
    scores = q.double().transpose(1, 2) @ k.double().repeat_interleave(heads, 2).transpose(1, 2).transpose(-1, -2)
    scores = scores / math.sqrt(head_dim) + mask.double()
    want = (scores.softmax(-1) @ v.double().repeat_interleave(heads, 2).transpose(1, 2)).transpose(1, 2).float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seen", [[(0, 30)], [(20, 50)], [(10, 20), (15, 40), (12, 13)]],
                         ids=["ring-not-wrapped", "middle", "rows-apart"])
def test_custom_sdpa_reads_only_the_keys_its_mask_can_show(ops_check, tmp_path, threads, seen):
    """With a mask, the kernel reads the key rows between the first and the last a query may
    see (a ring buffer that has not wrapped: the rows written so far, not the whole buffer).
    Rows outside hold NaN here: read, they would poison the output."""
    q_len, heads, kv_heads, head_dim, rows = len(seen), 6, 2, 16, 96
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, q_len, heads, head_dim, generator=g) * 2
    k = torch.randn(1, rows, kv_heads, head_dim, generator=g)
    v = torch.randn(1, rows, kv_heads, head_dim, generator=g)
    mask = torch.full((q_len, rows), float("-inf"))
    for i, (lo, hi) in enumerate(seen):
        mask[i, lo:hi] = 0.0
    first, last = min(lo for lo, _ in seen), max(hi for _, hi in seen)
    for t in (k, v):
        t[:, :first] = float("nan")
        t[:, last:] = float("nan")
    for name, t in (("q", q), ("k", k), ("v", v), ("mask", mask)):
        (tmp_path / f"{name}.bin").write_bytes(t.contiguous().numpy().tobytes())
    r = run_check(ops_check, tmp_path, "sdpa", batch=1, q_len=q_len, heads=heads, head_dim=head_dim, kv_len=rows,
                  kv_heads=kv_heads, start=0, causal=False, mask=1, threads=threads)
    assert r.returncode == 0, r.stderr
    got = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32).view(q.shape)
    inside = slice(first, last)
    keys = k[:, inside].double().repeat_interleave(heads // kv_heads, dim=2).transpose(1, 2)
    values = v[:, inside].double().repeat_interleave(heads // kv_heads, dim=2).transpose(1, 2)
    scores = q.double().transpose(1, 2) @ keys.transpose(-1, -2) / math.sqrt(head_dim) + mask[:, inside].double()
    want = (scores.softmax(-1) @ values).transpose(1, 2).float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def causal_or_window_mask(q_len, kv_len, start, window):
    """A NARROW_CASES call's additive mask and the check tool's parameters for it: causal
    from ``start`` (the kernel's own, not passed), or a sliding window over a ring buffer
    (passed as DIR/mask.bin)."""
    from llmcore.builtins.kv_cache import window_mask

    if window is None:
        visible = torch.arange(kv_len)[None, :] <= torch.arange(start, start + q_len)[:, None]
        return torch.zeros(q_len, kv_len).masked_fill(~visible, float("-inf")), dict(causal=True)
    return window_mask(torch.tensor([start]), q_len, 128, window, kv_len), dict(causal=False, mask=1)


def masked_reference(q, k, v, mask):
    """Attention in float64 of [B, S, H, D] queries over [B, kv_len, H_kv, D] keys and
    values, with an additive [S, kv_len] mask."""
    n_rep = q.shape[2] // k.shape[2]
    keys = k.double().repeat_interleave(n_rep, dim=2).transpose(1, 2)
    values = v.double().repeat_interleave(n_rep, dim=2).transpose(1, 2)
    scores = q.double().transpose(1, 2) @ keys.transpose(-1, -2) / math.sqrt(q.shape[3]) + mask.double()
    return (scores.softmax(-1) @ values).transpose(1, 2)


@pytest.mark.parametrize("q_len,rows,window,start", [(4, 11, 6, 16), (40, 72, 16, 64), (24, 48, 24, 0)],
                         ids=["small", "chunk-past-the-ring", "first-chunk"])
def test_custom_sdpa_with_a_mask_matches_torch(ops_check, tmp_path, q_len, rows, window, start):
    """A sliding layer's call: a ring buffer holding positions out of order (small: 11 rows
    holding 9..19, a 4-token chunk at 16..19, a window of 6), a mask saying which row each
    query sees. The mask decides alone: start_pos is not read, and rows it hides (one never
    written, holding garbage) play no part. Each query row reads its own window
    (row_key_ranges), in row blocks and key blocks where the windows start and end at other
    keys: a 40-token chunk at 64..103 whose windows wrap the 72-row ring for some rows and
    not for others, and a first chunk whose rows see 1 to 24 keys."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401

    from llmcore.builtins.kv_cache import window_mask

    heads, kv_heads, head_dim = 6, 2, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, q_len, heads, head_dim, generator=g) * 2
    k = torch.randn(1, rows, kv_heads, head_dim, generator=g)
    v = torch.randn(1, rows, kv_heads, head_dim, generator=g)
    mask = window_mask(torch.tensor([start]), q_len, 128, window, rows)
    assert mask.shape == (q_len, rows) and torch.isinf(mask).any() and (mask == 0).any()
    for name, t in (("q", q), ("k", k), ("v", v), ("mask", mask)):
        (tmp_path / f"{name}.bin").write_bytes(t.contiguous().numpy().tobytes())
    r = run_check(ops_check, tmp_path, "sdpa", batch=1, q_len=q_len, heads=heads, head_dim=head_dim, kv_len=rows,
                  kv_heads=kv_heads, start=start, causal=False, mask=1)
    assert r.returncode == 0, r.stderr
    got = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32).view(q.shape)
    torch.testing.assert_close(got, masked_reference(q, k, v, mask).float(), rtol=2e-5, atol=2e-6)
    theirs = torch.ops.llama.custom_sdpa(q, k, v, start, mask, 0.0, False)  # ExecuTorch's kernel
    torch.testing.assert_close(got, theirs, rtol=2e-5, atol=2e-6)


NARROW_CASES = [
    # q_len, heads, head_dim, kv_len, kv_heads, start, window (a sliding layer's mask; None: causal)
    pytest.param(1, 9, 64, 256, 3, 200, None, id="decode-smollm2-shape"),
    pytest.param(1, 32, 64, 640, 8, 600, None, id="decode-every-head-an-item"),
    pytest.param(1, 8, 32, 640, 2, 600, 520, id="decode-window-every-head-an-item"),
    pytest.param(64, 9, 64, 128, 3, 20, None, id="prompt-smollm2-shape"),
    pytest.param(37, 8, 32, 128, 2, 20, None, id="prompt-gqa-odd-rows"),
    pytest.param(40, 6, 16, 72, 2, 64, 16, id="prompt-window-past-the-ring"),
]


@pytest.mark.parametrize("isa", [None, "portable"], ids=["best", "portable"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("q_len,heads,head_dim,kv_len,kv_heads,start,window", NARROW_CASES)
def test_custom_sdpa_on_a_16_bit_cache_matches_torch(ops_check, tmp_path, q_len, heads, head_dim, kv_len, kv_heads,
                                                     start, window, dtype, isa):
    """A 16-bit cache (--kv-cache-dtype fp16/bf16): the kernel widens its keys and values to
    float32 (a prompt's a block at a time) and narrows the output once. Against attention in
    float64 on the same 16-bit values, to the output type's rounding; decode steps and prompt
    rows, causal and under a sliding window's mask, in both compilations."""
    g = torch.Generator().manual_seed(q_len + heads)
    q = (torch.randn(1, q_len, heads, head_dim, generator=g) * 2).to(dtype)
    k = torch.randn(1, kv_len, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(1, kv_len, kv_heads, head_dim, generator=g).to(dtype)
    mask, params = causal_or_window_mask(q_len, kv_len, start, window)
    (tmp_path / "mask.bin").write_bytes(mask.contiguous().numpy().tobytes())
    for name, t in (("q", q), ("k", k), ("v", v)):
        (tmp_path / f"{name}.bin").write_bytes(t.contiguous().view(torch.int16).numpy().tobytes())
    env = None if isa is None else os.environ | {"LLMCORE_KERNELS_MAX_ISA": isa}
    r = run_check(ops_check, tmp_path, "sdpa", env=env, batch=1, q_len=q_len, heads=heads, head_dim=head_dim,
                  kv_len=kv_len, kv_heads=kv_heads, start=start, dtype="half" if dtype == torch.float16 else "bfloat16",
                  **params)
    assert r.returncode == 0, r.stderr
    got = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.int16).view(dtype).view(q.shape)
    want = masked_reference(q, k, v, mask)
    torch.testing.assert_close(got, want.to(dtype))


@pytest.mark.parametrize("isa", [None, "portable"], ids=["best", "portable"])
@pytest.mark.parametrize("q_len,heads,head_dim,kv_len,kv_heads,start,window", NARROW_CASES)
def test_custom_quantized_sdpa_on_an_int8_cache_matches_torch(ops_check, tmp_path, q_len, heads, head_dim, kv_len,
                                                              kv_heads, start, window, isa):
    """An int8 cache (--kv-cache-dtype int8): llama::custom_quantized_sdpa reads each row as
    (q - zero point) * scale, the prompt's blocks widened to float32 once. Against attention
    in float64 on the same rows read back, decode steps and prompt rows, causal and under a
    sliding window's mask, in both compilations."""
    g = torch.Generator().manual_seed(q_len + heads + 1)

    def int8_rows(rows, h):
        x = torch.randint(-128, 128, (1, rows, h, head_dim), generator=g, dtype=torch.int8)
        zero_points = torch.randint(-20, 21, (1, rows, h, 1), generator=g, dtype=torch.int8)
        scales = torch.rand(1, rows, h, 1, generator=g) * 0.02 + 0.005
        return x, scales, zero_points, (x.double() - zero_points.double()) * scales.double()

    mask, params = causal_or_window_mask(q_len, kv_len, start, window)
    tensors, read_back = {"mask": mask}, {}
    for name, rows, h in (("q", q_len, heads), ("k", kv_len, kv_heads), ("v", kv_len, kv_heads)):
        x, scales, zero_points, read_back[name] = int8_rows(rows, h)
        tensors.update({name: x, f"{name}_scales": scales, f"{name}_zero_points": zero_points})
    for name, t in tensors.items():
        (tmp_path / f"{name}.bin").write_bytes(t.contiguous().numpy().tobytes())
    env = None if isa is None else os.environ | {"LLMCORE_KERNELS_MAX_ISA": isa}
    r = run_check(ops_check, tmp_path, "sdpa", env=env, batch=1, q_len=q_len, heads=heads, head_dim=head_dim,
                  kv_len=kv_len, kv_heads=kv_heads, start=start, dtype="int8", **params)
    assert r.returncode == 0, r.stderr
    got = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32)
    got = got.view(1, q_len, heads, head_dim)
    want = masked_reference(read_back["q"], read_back["k"], read_back["v"], mask).float()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def capped_reference(q, k, v, start, mask, scale, softcap):
    """llmcore::softcap_sdpa in float64: causal from ``start`` without a mask, the additive
    ``mask`` alone with one; scores capped before the mask."""
    q, k, v = q.double(), k.double(), v.double()
    b, s, h, d = q.shape
    n_rep = h // k.shape[2]
    if mask is None:
        n = start + s
        k, v = k[:, :n], v[:, :n]
        mask = torch.zeros(s, n, dtype=torch.float64).masked_fill(
            torch.arange(n)[None, :] > torch.arange(start, n)[:, None], float("-inf"))
    keys = k.repeat_interleave(n_rep, dim=2).transpose(1, 2)
    values = v.repeat_interleave(n_rep, dim=2).transpose(1, 2)
    scores = q.transpose(1, 2) @ keys.transpose(-1, -2) * (1.0 / math.sqrt(d) if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap + mask.double()
    return (scores.softmax(-1) @ values).transpose(1, 2).float()


CAPPED_CASES = [
    # q_len, heads, head_dim, kv_len, kv_heads, start, scale, softcap, masked
    pytest.param(1, 9, 64, 1024, 3, 700, None, 50.0, False, id="decode-gqa-smollm2-shape"),
    pytest.param(37, 8, 32, 128, 2, 20, 0.4, 5.0, False, id="prefill-chunk-scores-past-the-cap"),
    pytest.param(64, 9, 64, 1024, 3, 500, None, 50.0, False, id="prompt-gqa-smollm2-shape"),
    pytest.param(3, 4, 13, 20, 2, 4, 0.5, 0.7, False, id="odd-head-dim-tight-cap"),
    pytest.param(4, 6, 16, 11, 2, 16, None, 3.0, True, id="ring-buffer-mask"),
]


@pytest.mark.parametrize("isa", [None, "portable"], ids=["best", "portable"])
@pytest.mark.parametrize("q_len,heads,head_dim,kv_len,kv_heads,start,scale,softcap,masked", CAPPED_CASES)
def test_softcap_sdpa_matches_torch(ops_check, tmp_path, q_len, heads, head_dim, kv_len, kv_heads, start, scale,
                                    softcap, masked, isa):
    """llmcore::softcap_sdpa (Gemma 2's attention): each score capped at softcap * tanh(s /
    softcap) before the mask, in both compilations; scores well past the cap (queries x3)
    and a sliding layer's ring buffer mask. Rows past the attended ones hold NaN (no mask)."""
    from llmcore.builtins import runtime_attention
    from llmcore.builtins.kv_cache import window_mask

    g = torch.Generator().manual_seed(q_len * 31 + heads)
    q = torch.randn(1, q_len, heads, head_dim, generator=g) * 3
    k = torch.randn(1, kv_len, kv_heads, head_dim, generator=g)
    v = torch.randn(1, kv_len, kv_heads, head_dim, generator=g)
    mask = window_mask(torch.tensor([start]), q_len, 64, 6, kv_len) if masked else None
    if not masked:
        k[:, start + q_len:] = float("nan")
        v[:, start + q_len:] = float("nan")
    for name, t in (("q", q), ("k", k), ("v", v)) + ((("mask", mask),) if masked else ()):
        (tmp_path / f"{name}.bin").write_bytes(t.contiguous().numpy().tobytes())
    env = None if isa is None else os.environ | {"LLMCORE_KERNELS_MAX_ISA": isa}
    r = run_check(ops_check, tmp_path, "sdpa", env=env, batch=1, q_len=q_len, heads=heads, head_dim=head_dim,
                  kv_len=kv_len, kv_heads=kv_heads, start=start, mask=int(masked), scale=scale, softcap=softcap)
    assert r.returncode == 0, r.stderr
    if isa == "portable":
        assert "isa=portable" in r.stdout, r.stdout
    got = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32).view(q.shape)
    want = capped_reference(q, k, v, start, mask, scale, softcap)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=3e-6)
    # the op's PyTorch kernel (eager runs, the parity reference) computes the same
    runtime_attention.define()
    eager = torch.ops.llmcore.softcap_sdpa(q, torch.nan_to_num(k), torch.nan_to_num(v), start, mask, scale, softcap)
    torch.testing.assert_close(eager, want, rtol=2e-5, atol=3e-6)
    # the cap matters here: custom_sdpa's result is far from it
    uncapped = reference_sdpa(q, torch.nan_to_num(k), torch.nan_to_num(v), start, True, scale) if not masked else None
    if uncapped is not None:
        assert (uncapped - want).abs().max() > 1e-2


def test_softcap_sdpa_refuses_a_cap_that_is_not_positive(ops_check, tmp_path):
    q = torch.randn(1, 1, 2, 8)
    k = torch.randn(1, 4, 2, 8)
    for name, t in (("q", q), ("k", k), ("v", k)):
        (tmp_path / f"{name}.bin").write_bytes(t.numpy().tobytes())
    r = run_check(ops_check, tmp_path, "sdpa", batch=1, q_len=1, heads=2, head_dim=8, kv_len=4, kv_heads=2, start=0,
                  softcap=0.0)
    assert r.returncode != 0 and "softcap must be positive" in r.stderr, r.stderr


def quantize_rows_inputs(rows: int, n: int) -> torch.Tensor:
    """Rows a cache rounds, and the ones its arithmetic treats apart: all positive (the zero
    point at the bottom), all negative, all zero (the smallest scale), one value, values on
    rounding ties, a wide range, and a row whose zero point comes from its maximum."""
    g = torch.Generator().manual_seed(rows * 7 + n)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[0] = x[0].abs() + 1
    x[1] = -x[1].abs() - 1
    x[2] = 0
    x[3] = 0
    x[3, 0] = 5.0
    x[4] = torch.arange(n) * 0.5 - n / 4  # halves: ties once scaled?
    x[5] = torch.linspace(-1, 200, n)
    return x


@pytest.mark.parametrize("isa", [None, "portable"], ids=["best", "portable"])
@pytest.mark.parametrize("rows,n,threads", [(16, 64, 1), (2048, 64, 2), (9, 96, 2), (7, 5, 1)])
def test_quantize_rows_is_pytorchs_rounding_bit_for_bit(ops_check, tmp_path, rows, n, threads, isa):
    """llmcore::quantize_rows (an int8 cache's keys, values and queries): the integers, scales
    and zero points PyTorch's quantized_decomposed per-token ops give, exactly, for a decode
    step's few rows and a prefill's many (split across threads), in both compilations; and
    the op's PyTorch kernel is those ops."""
    from llmcore.builtins import runtime_attention

    x = quantize_rows_inputs(rows, n)
    (tmp_path / "x.bin").write_bytes(x.numpy().tobytes())
    env = None if isa is None else os.environ | {"LLMCORE_KERNELS_MAX_ISA": isa}
    r = run_check(ops_check, tmp_path, "quantize_rows", env=env, rows=rows, n=n, threads=threads)
    assert r.returncode == 0, r.stderr
    want_q, want_scales, want_zero_points = runtime_attention.quantize_rows(x)
    read = lambda name, dtype, shape: torch.frombuffer(bytearray((tmp_path / name).read_bytes()), dtype=dtype).view(shape)
    assert torch.equal(read("scales.bin", torch.float32, (rows, 1)), want_scales)
    assert torch.equal(read("zero_points.bin", torch.int8, (rows, 1)), want_zero_points)
    assert torch.equal(read("q.bin", torch.int8, (rows, n)), want_q)
    assert want_q.min() == -128 and want_q.max() == 127  # the rows reach both ends
    runtime_attention.define()
    for got, want in zip(torch.ops.llmcore.quantize_rows(x), (want_q, want_scales, want_zero_points)):
        assert torch.equal(got, want)


def test_update_cache_with_indices_writes_its_rows(ops_check, tmp_path):
    """Positions 9..11 into a ring buffer of 5 rows: rows 4, 0, 1; the others untouched;
    the same as ExecuTorch's kernel."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401

    value = torch.randn(1, 3, 2, 8)
    cache = torch.randn(1, 5, 2, 8)
    indices = torch.tensor([[4, 0, 1]])
    for name, t in (("value", value), ("cache", cache), ("indices", indices)):
        (tmp_path / f"{name}.bin").write_bytes(t.numpy().tobytes())
    r = run_check(ops_check, tmp_path, "update_cache", batch=1, seq=3, heads=2, head_dim=8, capacity=5, start=9,
                  indices=1)
    assert r.returncode == 0, r.stderr
    got = torch.frombuffer(bytearray((tmp_path / "cache_out.bin").read_bytes()), dtype=torch.float32).view(cache.shape)
    want = cache.clone()
    want[0, [4, 0, 1]] = value[0]
    assert torch.equal(got, want)
    theirs = cache.clone()
    torch.ops.llama.update_cache_with_indices(value, theirs, 9, indices)
    assert torch.equal(got, theirs)


# (seq, heads, head_dim, capacity, start, threads): a decode-sized write, and prompts whose
# 16 KiB or more the kernel shares among the threads (SmolLM2's 64-token prompt: 48 KiB).
UPDATE_CACHE_CASES = [(3, 4, 8, 10, 5, 2), (64, 3, 64, 100, 7, 2), (64, 3, 64, 100, 7, 3), (37, 4, 32, 40, 3, 2)]


@pytest.mark.parametrize("seq,heads,head_dim,capacity,start,threads", UPDATE_CACHE_CASES)
def test_update_cache_writes_only_its_rows(ops_check, tmp_path, seq, heads, head_dim, capacity, start, threads):
    value = torch.randn(2, seq, heads, head_dim)
    cache = torch.randn(2, capacity, heads, head_dim)
    (tmp_path / "value.bin").write_bytes(value.numpy().tobytes())
    (tmp_path / "cache.bin").write_bytes(cache.numpy().tobytes())
    r = run_check(ops_check, tmp_path, "update_cache", batch=2, seq=seq, heads=heads, head_dim=head_dim,
                  capacity=capacity, start=start, threads=threads)
    assert r.returncode == 0, r.stderr
    got = torch.frombuffer(bytearray((tmp_path / "cache_out.bin").read_bytes()), dtype=torch.float32).view(cache.shape)
    want = cache.clone()
    want[:, start:start + seq] = value
    assert torch.equal(got, want)


def parallel_rounds(ops_check, **params):
    """kernel_parallel_for run by llmcore_llm_ops_check's "parallel": one dict a round."""
    r = run_check(ops_check, "-", "parallel", **params)
    assert r.returncode == 0, r.stderr
    return [dict(field.split("=") for field in line.split()) for line in r.stdout.splitlines()]


# (begin, end, grain, threads): parts of one item, of several with a short last one, fewer
# items than threads, one part, and a range that does not start at 0.
@pytest.mark.parametrize("begin,end,grain,threads", [(0, 16, 1, 2), (0, 37, 5, 2), (0, 2, 1, 3), (0, 5, 8, 2),
                                                     (7, 30, 4, 3)])
def test_the_kernel_threads_cover_each_item_once(ops_check, begin, end, grain, threads):
    """The pool the kernels share (kernel_threads.h): every item of every region once, in
    parts of `grain` items, on no more threads in a region than it has parts (a thread
    takes part by taking one); with more than one part and thread, more than one thread
    takes part (each part busy 3 ms, so that a worker claims one before the caller is done;
    on a 2-core machine a third thread may find no core free in time, so at least two).
    Three regions a round, four rounds: a region's parts may go to other threads in the
    next, so the threads of a round together can outnumber its parts."""
    rounds = parallel_rounds(ops_check, begin=begin, end=end, grain=grain, threads=threads, work_us=3000, rounds=4)
    parts = -(-(end - begin) // grain)
    for round_ in rounds:
        assert round_["items"] == str(end - begin)
        assert round_["covered_once"] == "1" and round_["parts_ok"] == "1"
        assert 1 <= int(round_["region_threads_max"]) <= min(threads, parts)
    if parts == 1:  # run on the caller alone: the pool's threads never started
        assert all(r["threads_used"] == "1" and r["awake_after"] == "0" for r in rounds)
    else:
        assert max(int(r["region_threads_max"]) for r in rounds) >= 2


@pytest.mark.parametrize("end,threads", [(2, 2), (16, 3)])
def test_the_kernel_threads_poll_after_a_region_then_sleep(ops_check, end, threads):
    """After a region the workers keep polling (the attention runs between two layer
    operators' regions, and finds them awake), and 50 ms later they are asleep. Polling is
    certain while less than the poll time has passed since the region began, every
    worker's polling having started after that: short regions (parts of 20 us), and a
    round whose check came later (the caller kept off its core by a busy host) tells
    nothing; one of sixteen must come in time."""
    rounds = parallel_rounds(ops_check, end=end, threads=threads, work_us=20, rounds=16)
    assert all(r["awake_later"] == "0" for r in rounds)
    timely = [r for r in rounds if int(r["since_region_us"]) < int(r["poll_us"])]
    assert timely, [r["since_region_us"] for r in rounds]
    assert all(r["awake_after"] == "1" for r in timely), [(r["since_region_us"], r["awake_after"]) for r in timely]


def test_the_kernel_threads_follow_the_runtime_pool_size(ops_check):
    """The pool has as many threads as ExecuTorch's: resized to one, a region runs on the
    calling thread alone; from one to three, on more than one."""
    first, second = parallel_rounds(ops_check, end=12, threads=3, then_threads=1, work_us=1000)
    assert int(first["threads_used"]) >= 2 and second["threads_used"] == "1"
    assert first["covered_once"] == second["covered_once"] == "1"
    first, second = parallel_rounds(ops_check, end=12, threads=1, then_threads=3, work_us=1000)
    assert first["threads_used"] == "1" and int(second["threads_used"]) >= 2
    assert first["covered_once"] == second["covered_once"] == "1"


def test_a_region_opened_inside_a_region_runs_on_its_thread(ops_check):
    """A body that calls kernel_parallel_for again (a kernel calling another) gets the
    whole inner range on its own thread, and the outer region still covers every item."""
    (round_,) = parallel_rounds(ops_check, end=8, threads=2, nested=1)
    assert round_["nested_inline"] == "1" and round_["covered_once"] == "1"


def test_the_ops_are_registered(ops_check):
    out = subprocess.run([str(ops_check), "registered"], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["llama::update_cache.out", "llama::update_cache_with_indices.out", "llama::custom_sdpa.out",
                   "llama::custom_quantized_sdpa.out", "llmcore::softcap_sdpa.out", "llmcore::quantize_rows.out"]


@pytest.mark.parametrize(
    "command,params,message",
    [
        ("sdpa", dict(mask=1, causal=1), "attn_mask and is_causal"),
        ("sdpa", dict(mask=1, causal=0, dtype="double"), "float32, float16 or bfloat16"),
        ("sdpa", dict(dropout=0.1), "dropout_p must be 0"),
        ("sdpa", dict(dtype="double"), "float32, float16 or bfloat16"),
        ("sdpa", dict(mask_dtype="half", mask=1, causal=0), "attn_mask must be a contiguous float32"),
        ("sdpa", dict(heads=3, kv_heads=2), "not a multiple"),
        ("sdpa", dict(start=6, q_len=4, kv_len=8), "outside the cache"),
        ("update_cache", dict(start=7, seq=2, capacity=8), "outside the cache"),
        ("update_cache", dict(dtype="double"), "float32, float16, bfloat16 or int8"),
        ("update_cache", dict(indices=1, capacity=4, seq=1), "outside the cache"),
    ],
)
def test_refused_arguments(ops_check, tmp_path, command, params, message):
    base = dict(batch=1, heads=2, head_dim=8)
    if command == "sdpa":
        base.update(q_len=2, kv_len=8, kv_heads=2, start=0)
        base.update(params)
        for name, rows, h in (("q", base["q_len"], base["heads"]), ("k", base["kv_len"], base["kv_heads"]),
                              ("v", base["kv_len"], base["kv_heads"])):
            (tmp_path / f"{name}.bin").write_bytes(torch.zeros(rows, h, 8).numpy().tobytes())
        (tmp_path / "mask.bin").write_bytes(torch.zeros(base["q_len"], base["kv_len"]).numpy().tobytes())
    else:
        base.update(seq=1, capacity=8, start=0)
        base.update(params)
        (tmp_path / "value.bin").write_bytes(torch.zeros(base["seq"], 2, 8).numpy().tobytes())
        (tmp_path / "cache.bin").write_bytes(torch.zeros(base["capacity"], 2, 8).numpy().tobytes())
        (tmp_path / "indices.bin").write_bytes(torch.full((base["seq"],), 9).numpy().tobytes())  # row 9 of 4
    r = run_check(ops_check, tmp_path, command, **base)
    assert r.returncode == 1, r.stderr
    assert message in r.stderr


# --------------------------------------------------------------------------
# programs
# --------------------------------------------------------------------------


def test_runner_agrees_with_llmcore_run_on_kv_program(binaries, programs, cli):  # noqa: F811
    """kv.pte (tests/runtime/make_test_pte.py): runner with llmcore's kernels vs `llmcore run`
    with ExecuTorch's (prompts within the program's 16-token calls)."""
    for prompt in ["Hello the world", "<|im_start|>user\nwhere are they?<|im_end|>\n"]:
        _, out, _ = run_runner(programs / "kv.pte", prompt, "--max-new-tokens", 40, "--temperature", 0, "--print-ids")
        result = cli("run", str(programs / "kv.pte"), "--prompt", prompt, "--max-new-tokens", "40", "--json")
        assert result.returncode == 0, result.stderr
        assert parse_ids(out) == json.loads(result.stdout)["generated_ids"]


class GQABlock(nn.Module):
    """Attention with 6 query heads over 2 key/value heads, through the llama:: ops,
    with an explicit softmax scale."""

    def __init__(self, dim, n_heads, n_kv_heads, max_ctx, scale):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.hd, self.scale = n_heads, n_kv_heads, dim // n_heads, scale
        self.ln = nn.LayerNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        shape = (1, max_ctx, n_kv_heads, self.hd)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, x, start):
        b, t, d = x.shape
        h = self.ln(x)
        q = self.wq(h).view(b, t, self.n_heads, self.hd)
        k = self.wk(h).view(b, t, self.n_kv_heads, self.hd)
        v = self.wv(h).view(b, t, self.n_kv_heads, self.hd)
        torch.ops.llama.update_cache(k, self.k_cache, start)
        torch.ops.llama.update_cache(v, self.v_cache, start)
        y = torch.ops.llama.custom_sdpa(q, self.k_cache, self.v_cache, start, None, 0.0, True, self.scale)
        return x + self.wo(y.reshape(b, t, d))


@pytest.fixture(scope="module")
def gqa_program(programs, tmp_path_factory):  # noqa: F811
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    import make_test_pte as m

    tok = json.loads((programs / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"])
    max_seq, max_ctx, dim = 12, 96, 48
    torch.manual_seed(7)
    model = m.TinyGPT(vocab, dim=dim, n_layers=2, n_heads=6, max_ctx=max_ctx, kv=True)
    model.blocks = nn.ModuleList([GQABlock(dim, 6, 2, max_ctx, 0.35) for _ in range(2)])
    model.eval()
    out = tmp_path_factory.mktemp("gqa")
    shutil.copy(programs / "tokenizer.json", out / "tokenizer.json")
    eos = tok["model"]["vocab"]["<|im_end|>"]
    cm = dict(get_vocab_size=vocab, get_bos_id=-1, get_eos_ids=[eos], get_max_seq_len=max_seq,
              get_max_context_len=max_ctx, get_n_bos=0, use_kv_cache=True, use_sdpa_with_kv_cache=True,
              enable_dynamic_shape=True)
    t = torch.export.Dim("t", min=1, max=max_seq)
    example = (torch.zeros(1, 4, dtype=torch.long), torch.tensor([0], dtype=torch.long))
    with torch.no_grad():
        m.export_pte(model, example, ({1: t}, None), cm, str(out / "gqa.pte"))
    return out / "gqa.pte"


@pytest.mark.parametrize(
    "prompt",
    ["Hi", "The quick brown fox jumps over the lazy dog, and then some more words follow here"],
)
def test_runner_matches_reference_on_gqa_program(binaries, gqa_program, prompt):  # noqa: F811
    """6 query / 2 kv heads, scale 0.35, prefill in 12-token chunks, then decode; against
    the Python reference loop (ExecuTorch's kernels through the pybindings)."""
    import tokenizers
    from pte_reference import reference_generate

    ids = tokenizers.Tokenizer.from_file(str(gqa_program.parent / "tokenizer.json")).encode(
        prompt, add_special_tokens=False).ids
    want = reference_generate(gqa_program, ids, 30)
    _, out, _ = run_runner(gqa_program, prompt, "--max-new-tokens", 30, "--temperature", 0, "--print-ids")
    assert parse_ids(out) == want
    assert len(set(want)) > 3  # not a degenerate repetition


# An int8 cache's program run by the Python runtime: prefill, then decode steps; each call's
# logits and how many attention calls reached libllmcore_llm_ops.so's keyed kernel.
_PYTHON_RUN = r"""
import json, sys
from llmcore.runtime import Program, libraries
program = Program.load(sys.argv[1])
rows = [program.logits([5, 17, 3, 9, 40, 2], 0).tolist()]
for pos, token in enumerate([7, 11, 13], start=6):
    rows.append(program.logits([token], pos).tolist())
handle = next(h for path, h in libraries._handles.items() if path.endswith("libllmcore_llm_ops.so"))
print(json.dumps({"logits": rows, "calls": handle.llmcore_llm_ops_sdpa_calls()}))
"""


def test_python_runs_the_runtimes_int8_cache_attention(binaries, tmp_path):  # noqa: F811
    """An int8 cache's program in a Python process: its rounding (llmcore::quantize_rows)
    loads libllmcore_llm_ops.so, whose llama::custom_quantized_sdpa kernel is keyed for int8
    calls, so every attention call reaches it (ExecuTorch's own decoded SmolLM2 at a quarter
    of the runner's speed); the export's parity check, in a process that loaded it too, finds
    the program's logits the eager model's (ExecuTorch's PyTorch kernel of the op)."""
    import sys

    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    out = tmp_path / "int8.pte"
    result = export(ExportOptions(model="llama", config="tiny", plugins=["xnnpack"], kv_cache_dtype="int8",
                                  output=str(out), quiet=True), load_registry())
    parity = result.report["parity"]
    assert parity["top1_agreement"] == 1.0 and parity["max_abs_diff"] < 0.05, parity
    done = subprocess.run([sys.executable, "-c", _PYTHON_RUN, str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ran = json.loads(done.stdout.strip().splitlines()[-1])
    assert ran["calls"] == 4 * 2  # each forward call, each of the tiny model's two layers
    assert all(math.isfinite(x) for row in ran["logits"] for x in row)
