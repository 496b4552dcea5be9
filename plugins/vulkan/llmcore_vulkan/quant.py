"""The ``vulkan-8w`` quantizer: ExecuTorch's ``VulkanQuantizer``, int8 weights only.

Before annotating, ``VulkanQuantizer`` turns every scalar operand of the graph into a
tensor constant (so that binary ops with scalars could be quantized). With weight-only
linear quantization nothing uses them, and they break the Vulkan delegate's RMSNorm
fusion afterwards: its pattern reads ``eps`` with ``.item()`` and, on the re-exported
graph, gets a symbolic float (``GuardOnDataDependentSymNode: zuf0``), so every Llama
lowering failed. :class:`WeightOnlyVulkanQuantizer` leaves the scalars as they are.
"""

from __future__ import annotations


def weight_only_quantizer(options: dict):
    """The ``vulkan-8w`` recipe's pt2e quantizer (it takes no options)."""
    from llmcore_vulkan.partition import quiet_import

    quiet_import()
    from executorch.backends.vulkan.quantizer.vulkan_quantizer import (
        VulkanQuantizer,
        get_symmetric_quantization_config,
    )

    class WeightOnlyVulkanQuantizer(VulkanQuantizer):
        """int8 per-channel weights of linear layers; scalars stay scalars."""

        def transform_for_annotation(self, model):
            return model

    quantizer = WeightOnlyVulkanQuantizer()
    return quantizer.set_global(get_symmetric_quantization_config(is_dynamic=False, weight_bits=8))
