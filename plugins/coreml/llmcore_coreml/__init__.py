"""Core ML for llmcore: ExecuTorch's Core ML delegate (Apple CPU, GPU and Neural Engine).

Provides

* the ``coreml`` backend: ExecuTorch's ``CoreMLPartitioner`` with compile specs from the
  backend options (compute units, precision, deployment target); with a KV cache, the
  cache becomes Core ML state (iOS 18 / macOS 15) unless ``cache_as_state=false``;
* weight-only quantizer recipes that Core ML lowers (:mod:`llmcore_coreml.quant`):
  ``coreml-8w`` (int8 per channel) and ``coreml-4w`` (int4 per group), both torchao, and
  ``coreml-pt2e-8w`` (Core ML's own pt2e ``CoreMLQuantizer``, int8 per channel);
* the ``coreml-attention`` source transform, automatic whenever ``coreml`` is selected:
  attention through Core ML's fused SDPA op (``coreml::sdpa``), with a cache Core ML can
  convert in place of the custom-op cache (:mod:`llmcore_coreml.attention`).

Programs lowered here run on Apple devices only; the pip wheel's runtime has no Core ML
backend, so ``llmcore export`` skips its parity check and says so. coremltools can still
read what the delegate carries: :mod:`llmcore_coreml.payload` extracts the Core ML model
package from a ``.pte``.
"""

from __future__ import annotations

from llmcore import hookimpl
from llmcore.records import Backend, EdgeSettings, Lazy, QuantizerRecipe, SourceTransform

__version__ = "0.1.0"

BACKEND = "coreml"
RUNTIME_ID = "CoreMLBackend"
RUNS_ON = (
    "Apple devices (macOS, iOS; iOS 18 / macOS 15 for programs with a KV cache) through Core ML, "
    "with an ExecuTorch runtime built with the Core ML backend"
)


def _torchao_8w(module, options: dict):
    from llmcore_coreml.quant import quantize_weights

    return quantize_weights(module, 8)


def _torchao_4w(module, options: dict):
    from llmcore_coreml.quant import quantize_weights

    return quantize_weights(module, 4, options["group_size"])


@hookimpl
def llmcore_partitioners() -> list[Backend]:
    return [
        Backend(
            name=BACKEND,
            description="Core ML: Apple CPU, GPU and Neural Engine (macOS, iOS)",
            partitioners=Lazy("llmcore_coreml.partition", "make_partitioners"),
            edge=EdgeSettings(check_ir_validity=False),
            runtime_id=RUNTIME_ID,
            runs_on=RUNS_ON,
            options={
                "compute_units": (str, "all", "all, cpu_only, cpu_and_gpu or cpu_and_ne"),
                "precision": (str, "fp16", "compute precision: fp16 or fp32"),
                "minimum_deployment_target": (
                    str,
                    "iOS18",
                    "a coremltools target (iOS16, iOS17, iOS18, macOS15, ...); iOS18/macOS15 for the fused SDPA, "
                    "the cache as state and int4 weights",
                ),
                "cache_as_state": (
                    bool,
                    True,
                    "the KV cache lives in the delegate as Core ML state (iOS 18 / macOS 15); false leaves it to "
                    "the ExecuTorch program",
                ),
            },
        )
    ]


@hookimpl
def llmcore_quantizers() -> list[QuantizerRecipe]:
    return [
        QuantizerRecipe(
            name="coreml-8w",
            description="int8 weights (symmetric, per output channel) for every linear layer (torchao); Core ML "
            "stores them as int8 and dequantizes on the fly (minimum_deployment_target iOS18 or later)",
            backends=(BACKEND,),
            source_quantize=_torchao_8w,
        ),
        QuantizerRecipe(
            name="coreml-4w",
            description="int4 weights (symmetric, per group) for linear layers (torchao), Core ML's blockwise int4 "
            "weights (minimum_deployment_target iOS18 or later); layers the group does not divide stay fp",
            backends=(BACKEND,),
            source_quantize=_torchao_4w,
            options={"group_size": (int, 32, "in-features per int4 scale: 16, 32, 64 or 128")},
        ),
        QuantizerRecipe(
            name="coreml-pt2e-8w",
            description="int8 weights (per output channel) with Core ML's own pt2e CoreMLQuantizer; lowers like "
            "coreml-8w, but its pattern matching takes long whatever the model size (docs/backends.md)",
            backends=(BACKEND,),
            pt2e_quantizer=Lazy("llmcore_coreml.quant", "weight_only_int8_quantizer"),
        ),
    ]


@hookimpl
def llmcore_source_transforms() -> list[SourceTransform]:
    return [
        SourceTransform(
            name="coreml-attention",
            description="attention through Core ML's fused SDPA (coreml::sdpa); the custom-op KV cache becomes a "
            "cache Core ML converts (index_put_ into [S, H, D] buffers)",
            apply=Lazy("llmcore_coreml.attention", "apply"),
            order=60,
            backends=(BACKEND,),
            automatic=True,
        )
    ]
