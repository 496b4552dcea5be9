"""A GGUF's Q4_K linears with their super-blocks' headers as the file holds them
(csrc/int4_gemm.h, Format::q4_k): the kernels compute each block's scale and offset from the
file's 6-bit codes (4.5 bits a weight, the exact values) where int4 blocks round the scale to
bfloat16 and the offset to float16 (5 bits a weight). Checked against the gguf package's own
dequantization (the values), the module the kernels replace (it computes with those exact
values while it holds the headers; inside kernels_rounding with the kernels' int8 activations,
per block of 32, in float), a float64 product, and a token
decoded alone against the same token in a prompt, on every instruction set the machine can
present."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from llmcore_xnnpack.qlinear import kernels_rounding


def q4_k_linear(rows: int, cols: int, seed: int, headers: bool = True):
    """A BlockInt4Linear from random well-formed Q4_K super-blocks, held as the ``gguf`` recipe
    holds one for the kernels (nibbles, the file's headers kept; without ``headers``, bf16
    scales and float16 offsets), and the weight's values as the gguf package dequantizes them
    (fp32 [rows, cols])."""
    import gguf
    from llmcore_llama.quants import integers_q4_k
    from llmcore_llama.testing import random_k_blocks
    from llmcore_xnnpack import qlinear

    raw = random_k_blocks(gguf.GGMLQuantizationType.Q4_K, rows, cols, seed=seed, scale=0.002)
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(rows, cols).astype(np.float32)
    q, scales, offsets = integers_q4_k(torch.from_numpy(raw).reshape(-1))
    kept = torch.from_numpy(raw).view(rows, cols // 256, 144)[..., :16].contiguous() if headers else None
    linear = qlinear.BlockInt4Linear(q.view(rows, cols), scales.view(rows, -1), offsets.view(rows, -1),
                                     nibbles=True, q4_k_headers=kept)
    return linear, torch.from_numpy(values)


def test_the_headers_give_the_files_values():
    """llmcore.stored.q4_k_block_values (what the kernels compute from the same bytes) gives
    the gguf package's values: each block's scale exactly (d times a 6-bit code), and
    ``scale * (u - 8) + offset`` within one rounding of ``d sc u - dmin m``."""
    from llmcore.stored import q4_k_block_values

    linear, values = q4_k_linear(12, 512, seed=1)
    scales, offsets = q4_k_block_values(linear.q4_k_headers)
    q = linear.integers().float().view(12, -1, 32)
    ours = (q * scales.reshape(12, -1, 1) + offsets.reshape(12, -1, 1)).reshape(12, 512)
    assert float((ours - values).abs().max()) <= 2e-7 * float(values.abs().max())


# 256 to 1024 inputs (one to four super-blocks); an odd number of outputs (a decode step reads
# rows in pairs half the range apart: a last row alone; a prompt's row tiles of 3 or 6, then
# pairs, then one); one token (a decode step) and more (a prompt's tiles of 2 or 4 tokens)
@pytest.mark.parametrize("tokens", [1, 2, 7, 33])
@pytest.mark.parametrize("out_features,in_features", [(96, 512), (9, 256), (40, 1024)])
def test_q4_k_on_the_kernel(kernel_library, tokens, out_features, in_features):
    from llmcore_kernels import ops  # noqa: F401  (registers the operators)
    from llmcore_kernels.layers import KernelLinear

    linear, values = q4_k_linear(out_features, in_features, seed=tokens)
    kernel = KernelLinear(linear)
    assert kernel.w_scales.dtype == torch.uint8 and torch.equal(kernel.w_scales, linear.q4_k_headers)
    assert kernel.w_offsets is None and "Q4_K" in repr(kernel)
    x = torch.randn(1, tokens, in_features, generator=torch.Generator().manual_seed(100 + tokens))
    with torch.no_grad(), kernels_rounding():
        got, want = kernel(x), linear(x)  # the module computes with the headers' exact values
        bf16 = q4_k_linear(out_features, in_features, seed=tokens, headers=False)[0](x)  # bf16 scales
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert float((bf16 - want).norm() / want.norm()) > 1e-4  # (so the check above tells them apart)
    # and near the float64 product of the unrounded activations (the int8 rounding's error only)
    exact = x.double() @ values.double().T
    assert float((got.double() - exact).norm() / exact.norm()) < 0.02
    # a token decoded alone gives what it gives in the prompt, bit for bit (the same sums, the
    # same float operations in the same order: int4_gemm_tiles.inc, add_q4_k_offsets)
    with torch.no_grad():
        last = kernel(x[:, -1:])
    assert torch.equal(last, got[:, -1:])


def test_q4_k_at_the_integers_limits(kernel_library):
    """The tiles' 16-bit pair sums at their largest: every nibble 15 (or 0), the largest
    codes (63) for scales and minima, and activations at the ends of their byte, against the
    module the kernel replaces on the headers' exact values."""
    from llmcore_kernels import ops  # noqa: F401
    from llmcore_kernels.layers import KernelLinear

    rows, cols = 6, 512
    linear, _ = q4_k_linear(rows, cols, seed=9)
    q = linear.q_nibbles.view(rows, -1)
    q[0:2], q[2] = 0xFF, 0x00  # u = 15 everywhere, u = 0 everywhere
    headers = linear.q4_k_headers
    headers[0:3, :, 4:16] = 0xFF  # every scale and minimum code 63
    headers[3, :, 4:16] = 0x00  # codes 0: a zero scale and no minimum
    signs = torch.randint(0, 2, (1, 5, cols), generator=torch.Generator().manual_seed(6)) * 2.0 - 1
    signs[0, 0] = 1.0  # a token whose every activation is the same
    with torch.no_grad(), kernels_rounding():  # the module computes with the edited headers' values too
        got, want = KernelLinear(linear)(signs), linear(signs)
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_a_stack_with_other_int4_takes_int4_blocks(kernel_library):
    """One projection stacking a Q4_K layer that kept its headers with one that did not (a
    file mixing Q4_K with Q4_1 in q, k and v, say): no single format holds both, so both go
    as int4 blocks, the Q4_K one with its headers' values rounded as XNNPACK takes them
    (bf16 scales, float16 offsets), and the operator gives what those two layers give."""
    from llmcore_kernels import mlp, ops  # noqa: F401

    with_headers, _ = q4_k_linear(8, 256, seed=1)
    other, _ = q4_k_linear(16, 256, seed=2, headers=False)
    rounded, _ = q4_k_linear(8, 256, seed=1, headers=False)  # the first one's int4 blocks form
    stacked = torch.nn.Module()
    mlp.register_linears(stacked, "w", [with_headers, other])
    assert stacked.w_scales.dtype == torch.bfloat16 and stacked.w_offsets is not None
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), kernels_rounding():
        got = torch.ops.llmcore.int4_linear.default(x, stacked.w, stacked.w_scales, stacked.w_sums, None,
                                                    stacked.w_offsets)
        want = torch.cat([rounded(x), other(x)], dim=-1)
    assert float((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("view", ["avxvnni", "avx2", "sse4"])
def test_q4_k_in_every_isa_view(kernel_library, passes_in_isa_view, view):
    """The same products on AVX-VNNI, AVX2 and the portable loops (AVX-512 natively)."""
    passes_in_isa_view(view, __file__, "q4_k_on_the_kernel or q4_k_at_the_integers_limits")


def test_xnnpack_drops_the_headers():
    """A layer holding Q4_K headers holds no bf16 scales or float16 offsets beside them (2
    bytes a block, not 4 more); left to XNNPACK (unpack_) it computes with those, rounded from
    the headers' values as a layer made without headers holds them: the headers go, so no
    program carries them unused."""
    linear, _ = q4_k_linear(8, 256, seed=2)
    twin, _ = q4_k_linear(8, 256, seed=2, headers=False)
    assert linear.q4_k_headers is not None and "Q4_K headers kept" in repr(linear)
    assert linear.scales is None and linear.offset_weight is None and linear.has_offsets
    linear.unpack_()
    twin.unpack_()
    assert linear.q4_k_headers is None and linear.q is not None and linear.has_offsets
    assert torch.equal(linear.q, twin.q) and torch.equal(linear.scales, twin.scales)
    assert torch.equal(linear.offset_weight, twin.offset_weight)
