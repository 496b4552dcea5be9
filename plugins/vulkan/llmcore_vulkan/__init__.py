"""Vulkan for llmcore: ExecuTorch's GPU backend for Android and desktop Vulkan drivers.

Provides

* the ``vulkan`` backend: ExecuTorch's Vulkan operator support, partitioned by llmcore's
  rules (:mod:`llmcore_vulkan.partition`), always with dynamic shapes (llmcore programs
  take a variable number of tokens);
* the ``vulkan-8w`` quantizer recipe: int8 weights, per output channel, symmetric, for
  every linear layer (ExecuTorch's ``VulkanQuantizer``, weight only);
* the ``vulkan-attention`` source transform, automatic whenever ``vulkan`` is selected:
  programs without a KV cache get an attention with a finite additive mask
  (:mod:`llmcore_vulkan.attention`). Programs with the default ``kv-cache`` keep it: its
  ``llama::update_cache`` / ``llama::custom_sdpa`` ops are Vulkan operators.

ExecuTorch's Vulkan modules are imported only inside the factories. Programs lowered
here run only with an ExecuTorch runtime built with the Vulkan backend
(``EXECUTORCH_BUILD_VULKAN=ON``); the pip wheel's runtime has none, so ``llmcore export``
skips its parity check and says so in the report.
"""

from __future__ import annotations

from llmcore import hookimpl
from llmcore.records import Backend, EdgeSettings, Lazy, QuantizerRecipe, SourceTransform

__version__ = "0.1.0"

BACKEND = "vulkan"
RUNTIME_ID = "VulkanBackend"
RUNS_ON = (
    "GPUs through Vulkan (Android; Linux and Windows with a Vulkan driver), with an ExecuTorch "
    "runtime built with EXECUTORCH_BUILD_VULKAN=ON"
)


def _partitioners(options: dict) -> list:
    from llmcore_vulkan.partition import make_partitioner

    return [
        make_partitioner(
            {
                "require_dynamic_shapes": True,
                "force_fp16": options["force_fp16"],
                "small_texture_limits": options["small_texture_limits"],
            }
        )
    ]


@hookimpl
def llmcore_partitioners() -> list[Backend]:
    return [
        Backend(
            name=BACKEND,
            description="Vulkan: ExecuTorch's GPU delegate (Android, desktop Vulkan drivers); fp32 or fp16",
            partitioners=_partitioners,
            edge=EdgeSettings(check_ir_validity=False),
            runtime_id=RUNTIME_ID,
            runs_on=RUNS_ON,
            options={
                "force_fp16": (bool, False, "compute in fp16 on the GPU (weights and activations)"),
                "small_texture_limits": (
                    bool,
                    False,
                    "assume the Vulkan spec's guaranteed 2048-texel 3D textures (older desktop GPUs) "
                    "instead of 16384 x 16384 x 2048",
                ),
            },
        )
    ]


@hookimpl
def llmcore_quantizers() -> list[QuantizerRecipe]:
    return [
        QuantizerRecipe(
            name="vulkan-8w",
            description="int8 weights (symmetric, per output channel) for every linear layer, fp32 activations; "
            "the Vulkan delegate runs them with its int8-weight linear kernels",
            backends=(BACKEND,),
            pt2e_quantizer=Lazy("llmcore_vulkan.quant", "weight_only_quantizer"),
        )
    ]


@hookimpl
def llmcore_source_transforms() -> list[SourceTransform]:
    return [
        SourceTransform(
            name="vulkan-attention",
            description="attention with a finite additive causal mask (the Vulkan serialiser cannot write -inf); "
            "applies to programs without a KV cache",
            apply=Lazy("llmcore_vulkan.attention", "apply"),
            order=60,
            backends=(BACKEND,),
            automatic=True,
        )
    ]
