"""A GGUF's Q6_K output layer kept as the file holds it (csrc/int4_gemm.h, Format::q6_k):
``llmcore::int4_linear`` on the file's super-blocks and ``llmcore::q6_k_embedding``, the
lookups of a token table tied to it. Checked against the gguf package's own dequantization
(the values), the module the kernels replace (llmcore_xnnpack.qlinear.StoredBlocksLinear: the
same per-token int8 activations times those values, in float) and a float64 product, on
every instruction set the machine can present."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def q6_k_weight(rows: int, cols: int, seed: int):
    """Random well-formed Q6_K super-blocks (uint8 [rows, cols/256, 210]) and their values as
    the gguf package dequantizes them (fp32 [rows, cols])."""
    import gguf
    from llmcore_llama.testing import random_k_blocks

    raw = random_k_blocks(gguf.GGMLQuantizationType.Q6_K, rows, cols, seed=seed, scale=0.002)
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(rows, cols).astype(np.float32)
    return torch.from_numpy(raw).view(rows, cols // 256, 210), torch.from_numpy(values)


def stored_linear(rows: int, cols: int, seed: int):
    from llmcore_xnnpack import qlinear

    blocks, values = q6_k_weight(rows, cols, seed)
    return qlinear.StoredBlocksLinear("Q6_K", blocks, lambda selected: values[selected], (rows, cols)), values


# 256 to 1024 inputs (one to four super-blocks); an odd number of outputs (the kernel reads
# rows in pairs half the range apart: a last row alone); one token (a decode step) and more
@pytest.mark.parametrize("tokens", [1, 2, 7])
@pytest.mark.parametrize("out_features,in_features", [(96, 512), (9, 256), (40, 1024)])
def test_q6_k_on_the_kernel(kernel_library, tokens, out_features, in_features):
    from llmcore_kernels import mlp, ops  # noqa: F401  (ops registers the operators)
    from llmcore_kernels.layers import KernelLinear

    linear, values = stored_linear(out_features, in_features, seed=tokens)
    kernel = KernelLinear(linear)
    assert kernel.w.data_ptr() == linear.blocks.data_ptr()  # the file's tensor itself
    assert "Q6_K super-blocks" in repr(kernel)
    x = torch.randn(1, tokens, in_features, generator=torch.Generator().manual_seed(100 + tokens))
    with torch.no_grad():
        got, want = kernel(x), linear(x)
    assert float((got - want).norm() / want.norm()) < 1e-5
    # and near the float64 product of the unrounded activations (the int8 rounding's error only)
    exact = x.double() @ values.double().T
    assert float((got.double() - exact).norm() / exact.norm()) < 0.02
    assert mlp.why_not_linear("linear", linear, offsets=True, int8=True, int8_blocks=True) is None
    assert "Q6_K" in mlp.why_not_linear("wv", linear, offsets=True, int8=True)  # the layer operators' roles


def test_q6_k_at_the_integers_limits(kernel_library):
    """The GEMV's 16-bit products and 32-bit sums at their largest: every value's q at 63 (or
    0), scales of -128 and 127, and activations at the ends of their byte (each input +1 or
    -1: 0 and 255 after the token's int8 rounding), against the module the kernel replaces.
    A saturated vpmaddubsw or an overflowed sum would be far outside the tolerance."""
    import gguf
    from llmcore_kernels import ops  # noqa: F401
    from llmcore_kernels.layers import KernelLinear
    from llmcore_xnnpack import qlinear

    rows, cols = 6, 512
    raw = np.random.default_rng(5).integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
    ql, qh, scales = slice(0, 128), slice(128, 192), slice(192, 208)
    raw[0:2, :, ql], raw[0:2, :, qh] = 0xFF, 0xFF  # q = 63 everywhere
    raw[2, :, ql], raw[2, :, qh] = 0, 0  # q = 0: the value -32
    raw[0, :, scales] = np.uint8(0x80)  # -128
    raw[1, :, scales], raw[2, :, scales] = 127, 0x80
    raw[3, :, scales] = np.tile(np.array([0x80, 127], dtype=np.uint8), 8)
    raw[:, :, 208:210] = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)  # d
    values = gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType.Q6_K).astype(np.float32)
    values = torch.from_numpy(values.reshape(rows, cols))
    blocks = torch.from_numpy(raw)
    linear = qlinear.StoredBlocksLinear("Q6_K", blocks, lambda selected: values[selected], (rows, cols))
    signs = torch.randint(0, 2, (1, 3, cols), generator=torch.Generator().manual_seed(6)) * 2.0 - 1
    signs[0, 0] = 1.0  # a token whose every activation is the same
    with torch.no_grad():
        got, want = KernelLinear(linear)(signs), linear(signs)
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_q6_k_lookups_are_the_files_values(kernel_library):
    """Each looked-up row is the gguf package's dequantization bit for bit."""
    from llmcore_kernels import ops  # noqa: F401

    blocks, values = q6_k_weight(33, 512, seed=3)
    ids = torch.tensor([[0, 32, 5], [7, 7, 1]])
    rows = torch.ops.llmcore.q6_k_embedding.default(blocks, ids)
    assert rows.shape == (2, 3, 512) and torch.equal(rows, values[ids])
    with pytest.raises(RuntimeError, match="outside the table's 33 rows"):
        torch.ops.llmcore.q6_k_embedding.default(blocks, torch.tensor([33]))


@pytest.mark.parametrize("view", ["avxvnni", "avx2", "sse4"])
def test_q6_k_in_every_isa_view(kernel_library, passes_in_isa_view, view):
    """The same products on AVX-VNNI, AVX2 and the portable loops (AVX-512 natively)."""
    passes_in_isa_view(view, __file__, "q6_k_on_the_kernel or q6_k_at_the_integers_limits or q6_k_lookups")


def test_an_untaken_q6_k_output_layer_is_refused_at_export():
    """XNNPACK takes no Q6_K: a StoredBlocksLinear left for torch.export stops the export with
    one line naming the fix, instead of a program without the layer's kernel."""
    from llmcore.errors import LlmcoreError

    from llmcore_xnnpack.qlinear import StoredBlocksEmbedding

    linear, values = stored_linear(8, 256, seed=0)
    with pytest.raises(LlmcoreError, match="q6_k_output=false"):
        torch.export.export(linear, (torch.randn(2, 256),))
    lookups = StoredBlocksEmbedding(linear)  # a table tied to it: its rows eagerly, refused at export
    assert lookups.blocks is linear.blocks and torch.equal(lookups(torch.tensor([[3, 1, 3]])), values[torch.tensor([[3, 1, 3]])])
    with pytest.raises(LlmcoreError, match="q6_k_output=false"):
        torch.export.export(lookups, (torch.tensor([[1, 2]]),))
