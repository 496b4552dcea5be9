"""llmcore::int4_linear on int8 blocks (csrc/int4_gemm.h, Format::int8_blocks): a GGUF's Q8_0
table as the file holds it, which a tied output layer and the embedding's lookups share.
Checked against the module it replaces (llmcore_xnnpack.qlinear.BlockInt8Linear: the same
int8 activations per block of 32 times the exact weights, in float) and a float64 product,
on every instruction set the machine can present."""

from __future__ import annotations

import pytest
import torch


def q8_0_linear(out_features: int, in_features: int, seed: int):
    """A BlockInt8Linear with Q8_0's ranges: integers in [-127, 127], fp16 scales (widened),
    some negative, spread over two orders of magnitude so that a block's scale matters."""
    from llmcore_xnnpack import qlinear

    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    magnitude = torch.exp(torch.rand(out_features, in_features // 32, generator=g) * 4.6) * 1e-4
    sign = torch.where(torch.rand(magnitude.shape, generator=g) < 0.2, -1.0, 1.0)
    scales = (magnitude * sign).half().float()
    return qlinear.BlockInt8Linear(q, scales)


# 576 and 1152 inputs: SmolLM2's and Gemma-3-1B's widths, 18 and 36 blocks; one block; an odd
# number of outputs (the kernel reads rows in pairs: a last row alone)
@pytest.mark.parametrize("rows", [1, 2, 7])
@pytest.mark.parametrize("out_features,in_features", [(96, 576), (40, 1152), (9, 32)])
def test_int8_blocks_on_the_kernel(kernel_library, rows, out_features, in_features):
    from llmcore_kernels import mlp, ops  # noqa: F401  (ops registers llmcore::int4_linear)
    from llmcore_kernels.layers import KernelLinear

    linear = q8_0_linear(out_features, in_features, seed=rows)
    kernel = KernelLinear(linear)
    assert kernel.w.data_ptr() == linear.q.data_ptr() and kernel.w_scales.data_ptr() == linear.scales.data_ptr()
    assert "int8 blocks of 32" in repr(kernel)
    x = torch.randn(1, rows, in_features, generator=torch.Generator().manual_seed(100 + rows))
    with torch.no_grad():
        got, want = kernel(x), linear(x)
    assert float((got - want).norm() / want.norm()) < 1e-5
    # and near the float64 product of the unrounded activations (the int8 rounding's error only)
    exact = x.double() @ linear.weight_values().double().T
    assert float((got.double() - exact).norm() / exact.norm()) < 0.02
    assert mlp.why_not_linear("linear", linear, offsets=True, int8=True, int8_blocks=True) is None
    assert "int8 blocks" in mlp.why_not_linear("wq", linear, offsets=True, int8=True)  # the layer operators' roles


@pytest.mark.parametrize("view", ["avxvnni", "avx2", "sse4"])
def test_int8_blocks_in_every_isa_view(kernel_library, passes_in_isa_view, view):
    """The same products on AVX-VNNI, AVX2 (widened to 16 bits) and the portable loops."""
    passes_in_isa_view(view, __file__, "int8_blocks_on_the_kernel")


def test_an_untaken_int8_blocks_layer_is_refused_at_export():
    """XNNPACK takes no int8 blocks: a BlockInt8Linear left for torch.export stops the export
    with one line naming the fix, instead of a program that dequantizes the table each call."""
    from llmcore.errors import LlmcoreError

    linear = q8_0_linear(8, 64, seed=0)
    with pytest.raises(LlmcoreError, match="tied_table=false"):
        torch.export.export(linear, (torch.randn(2, 64),))
