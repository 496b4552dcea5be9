"""QNN for llmcore: Qualcomm AI Engine Direct (the Hexagon NPU of Snapdragon SoCs).

Provides

* the ``qnn`` backend: ExecuTorch's ``QnnPartitioner`` with HTP compile specs for a
  chosen SoC. Lowering needs the Qualcomm AI Engine Direct SDK of the version the
  executorch wheel was built against (:data:`llmcore_qnn.sdk.QNN_SDK_VERSION`) at
  ``QNN_SDK_ROOT``; without it, the partitioner factory stops with one
  :class:`~llmcore.errors.LlmcoreError` saying so, before importing anything that
  needs the SDK;
* the ``qnn-8a8w`` and ``qnn-16a4w`` quantizer recipes (pt2e, ExecuTorch's
  ``QnnQuantizer``), which work without the SDK;
* source transforms, automatic with ``--plugins qnn``: ``qnn-single-head-attention``
  (which also turns the default custom-op KV cache into a plain-PyTorch one) and
  ``qnn-linear-to-conv2d`` (:mod:`llmcore_qnn.transforms`).

Nothing here imports ``executorch.backends.qualcomm`` at module level: importing that
package without ``QNN_SDK_ROOT`` downloads an SDK, so every import goes through
:func:`llmcore_qnn.sdk.import_qualcomm`, which switches that off.
"""

from __future__ import annotations

from llmcore import hookimpl
from llmcore.records import Backend, EdgeSettings, Lazy, QuantizerRecipe, SourceTransform

__version__ = "0.1.0"

BACKEND = "qnn"
RUNTIME_ID = "QnnBackend"
RUNS_ON = (
    "Snapdragon devices (Hexagon NPU through Qualcomm AI Engine Direct), with an ExecuTorch runtime "
    "built with EXECUTORCH_BUILD_QNN=ON and the QNN libraries on the device"
)

# The SoCs of the wheel's QcomChipset (executorch.backends.qualcomm.utils.utils.
# get_soc_to_chipset_map), listed here so that a typo fails before the SDK check.
SOC_MODELS = (
    "QCM6490", "QCS9100", "SA8255", "SA8295", "SA8797", "SAR2230P", "SM8350", "SM8450", "SM8475",
    "SM8550", "SM8650", "SM8750", "SM8845", "SM8850", "SSG2115P", "SSG2125P", "SW6100", "SXR1230P",
    "SXR2230P", "SXR2330P",
)


def _partitioners(options: dict) -> list:
    from llmcore.errors import LlmcoreError
    from llmcore_qnn.sdk import check_sdk, import_qualcomm

    soc = options["soc_model"].upper()
    if soc not in SOC_MODELS:
        raise LlmcoreError(
            f"unknown soc_model {options['soc_model']!r} for backend 'qnn'.",
            stage="options",
            plugin=BACKEND,
            fix=f"pass --backend-option qnn.soc_model= one of {', '.join(SOC_MODELS)}.",
        )
    check_sdk()  # one clear error, before anything that needs the SDK
    partitioner = import_qualcomm("executorch.backends.qualcomm.partition.qnn_partitioner")
    schema = import_qualcomm("executorch.backends.qualcomm.serialization.qc_schema")
    utils = import_qualcomm("executorch.backends.qualcomm.utils.utils")
    specs = utils.generate_qnn_executorch_compiler_spec(
        soc_model=getattr(schema.QcomChipset, soc),
        backend_options=utils.generate_htp_compiler_spec(use_fp16=options["use_fp16"]),
    )
    return [
        partitioner.QnnPartitioner(
            specs,
            skip_node_op_set={"llama.fallback.default"},
            skip_mutable_buffer=options["skip_mutable_buffer"],
        )
    ]


def _quantizer(quant_dtype: str, act_observer_minmax: bool, annotate_matmul_16a8w: bool):
    def make(options: dict):
        from llmcore_qnn.sdk import import_qualcomm

        quantizer = import_qualcomm("executorch.backends.qualcomm.quantizer.quantizer")
        kwargs = {}
        if act_observer_minmax:
            from torchao.quantization.pt2e import MinMaxObserver

            kwargs["act_observer"] = MinMaxObserver
        q = quantizer.QnnQuantizer()
        q.set_default_quant_config(
            getattr(quantizer.QuantDtype, quant_dtype),
            is_conv_per_channel=options["per_channel"],
            is_linear_per_channel=options["per_channel"],
            **kwargs,
        )
        if annotate_matmul_16a8w:
            custom = import_qualcomm("executorch.backends.qualcomm.quantizer.custom_annotation")
            q.add_custom_quant_annotations((custom.custom_annotate_llama_matmul_16a8w,))
        return q

    return make


@hookimpl
def llmcore_partitioners() -> list[Backend]:
    return [
        Backend(
            name=BACKEND,
            description="Qualcomm AI Engine Direct (QNN): the Hexagon NPU of Snapdragon SoCs; fp16 or "
            "quantized (qnn-8a8w, qnn-16a4w); lowering needs the QAIRT SDK at QNN_SDK_ROOT",
            partitioners=_partitioners,
            edge=EdgeSettings(check_ir_validity=False),
            runtime_id=RUNTIME_ID,
            runs_on=RUNS_ON,
            options={
                "soc_model": (str, "SM8650", f"target SoC: one of {', '.join(SOC_MODELS)}"),
                "use_fp16": (bool, True, "fp16 HTP graph for float ops (premium SoCs); quantized graphs ignore it"),
                "skip_mutable_buffer": (
                    bool,
                    True,
                    "leave the KV-cache buffers to the runtime (ExecuTorch's default for QNN LLMs)",
                ),
            },
        )
    ]


@hookimpl
def llmcore_quantizers() -> list[QuantizerRecipe]:
    per_channel = {"per_channel": (bool, True, "per-channel weight scales for linear and conv (else per tensor)")}
    return [
        QuantizerRecipe(
            name="qnn-8a8w",
            description="QnnQuantizer: 8-bit activations, 8-bit weights (static, calibrated on the prompt)",
            backends=(BACKEND,),
            pt2e_quantizer=_quantizer("use_8a8w", act_observer_minmax=False, annotate_matmul_16a8w=False),
            options=per_channel,
        ),
        QuantizerRecipe(
            name="qnn-16a4w",
            description="QnnQuantizer: 16-bit activations, 4-bit weights; attention matmuls 16a8w "
            "(ExecuTorch's recipe for Llama on HTP)",
            backends=(BACKEND,),
            pt2e_quantizer=_quantizer("use_16a4w", act_observer_minmax=True, annotate_matmul_16a8w=True),
            options=per_channel,
        ),
    ]


@hookimpl
def llmcore_source_transforms() -> list[SourceTransform]:
    return [
        SourceTransform(
            name="qnn-single-head-attention",
            description="multi-head attention as a loop of single-head attentions (HTP runs 2-D matmuls "
            "best), finite causal mask; a KV cache becomes plain PyTorch (QNN lacks the llama:: ops)",
            apply=Lazy("llmcore_qnn.transforms", "single_head_attention"),
            order=60,
            backends=(BACKEND,),
            automatic=True,
        ),
        SourceTransform(
            name="qnn-linear-to-conv2d",
            description="every nn.Linear as a 1x1 conv2d (faster on HTP); parameters and ties kept",
            apply=Lazy("llmcore_qnn.transforms", "linear_to_conv2d"),
            order=70,
            backends=(BACKEND,),
            automatic=True,
        ),
    ]
