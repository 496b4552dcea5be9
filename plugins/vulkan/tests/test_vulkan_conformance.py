"""Vulkan through llmcore's backend conformance kit, as `--plugins vulkan,xnnpack`.

The pip wheel's runtime has no Vulkan backend: the kit checks that the parity check is
skipped with the reason, and that --strict-parity then refuses to write the program.
"""

from llmcore.testing.conformance import BackendConformance


class TestVulkanConformance(BackendConformance):
    backend = "vulkan"
    runs_here = False
    fallbacks = ("xnnpack",)
