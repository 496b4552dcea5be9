"""Vulkan exports of the tiny models: what each backend takes, and what the GPU will run.

The pip wheel's runtime has no Vulkan backend, so these programs are not run here; their
Vulkan graphs are decoded with ExecuTorch's own Vulkan serialisation (flatc) instead.
"""

from __future__ import annotations

import pytest

from llmcore.testing.conformance import export_tiny, matmul_count, transformer_linear_layers
from llmcore_vulkan.payload import vk_operators

VK, XNN = "VulkanBackend", "XnnpackBackend"


def test_default_cache_program_is_one_vulkan_delegate_with_fused_attention():
    result = export_tiny("vulkan", "nanogpt", fallbacks=("xnnpack",))
    by_backend = result.report["delegation"]["by_backend"]
    assert by_backend[VK]["delegates"] == 1
    vk = by_backend[VK]["operators"]
    assert vk.get("llama_custom_sdpa_default") == 2 and vk.get("auto_functionalized_v2") == 4  # 2 layers, k and v
    # The position arithmetic (input_pos[0].item(), its asserts, the position-table slice) stays on the CPU.
    assert "_local_scalar_dense_default" not in vk and "_local_scalar_dense" not in vk
    ops = vk_operators(result.pte)
    assert ops["sdpa_with_kv_cache.default"] == 2
    assert matmul_count({name.replace(".", "_"): n for name, n in ops.items()}) >= 9  # 8 block linears + head


def test_llama_no_cache_vulkan_first_takes_the_layers():
    result = export_tiny("vulkan", "llama", fallbacks=("xnnpack",), skip_transforms=["kv-cache"])
    report = result.report
    assert report["transforms"] == ["vulkan-attention"]
    by_backend = report["delegation"]["by_backend"]
    assert matmul_count(by_backend[VK]["operators"]) >= transformer_linear_layers("llama")
    assert by_backend[VK]["operators"]["aten__softmax_default"] == 2
    # RoPE is a matmul with a pair-swap matrix, muls and adds, which Vulkan takes too: nothing
    # is left for XNNPACK (the XNNPACK-only rewrites do not run when Vulkan comes first).
    assert XNN not in by_backend
    assert report["transforms"] == ["vulkan-attention"]
    assert report["parity"]["missing_backends"] == [VK]


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
def test_vulkan_8w_runs_int8_weight_linear_kernels(family):
    # Llama also checks the RMSNorm fusion, which VulkanQuantizer's scalar-to-tensor step broke.
    linears = transformer_linear_layers(family) + 1  # the tied output layer is quantized too
    result = export_tiny("vulkan", family, fallbacks=("xnnpack",), quantize="vulkan-8w")
    vk = result.report["delegation"]["by_backend"][VK]["operators"]
    assert vk["quantized_decomposed_dequantize_per_channel_default"] == linears
    ops = vk_operators(result.pte)
    assert ops["aten._weight_int8pack_mm.default"] == linears
    assert ops["sdpa_with_kv_cache.default"] == 2
    if family == "llama":
        assert ops["et_vk.rms_norm.default"] == 5  # 2 per layer + the final norm
    fp32 = export_tiny("vulkan", family, fallbacks=("xnnpack",))
    assert result.report["outputs"]["pte_bytes"] < 0.8 * fp32.report["outputs"]["pte_bytes"]
