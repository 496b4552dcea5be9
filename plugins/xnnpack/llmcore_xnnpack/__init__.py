"""XNNPACK for llmcore: the CPU backend that runs everywhere ExecuTorch does.

Provides the ``xnnpack`` backend (its partitioners and edge settings), the
``int8-dynamic`` quantizer recipe, and the post-pass that turns leftover
``permute + mm`` pairs back into ``linear``. ExecuTorch's XNNPACK modules are imported
only inside the factories.
"""

from __future__ import annotations

from llmcore import hookimpl
from llmcore.records import Backend, EdgeSettings, PostPass, QuantizerRecipe

__version__ = "0.1.0"

BACKEND = "xnnpack"


def _partitioners(options: dict) -> list:
    from executorch.backends.xnnpack.partition.config.xnnpack_config import ConfigPrecisionType
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    kwargs = {"per_op_mode": options["per_op_mode"]}
    if options["fp32_only"]:
        kwargs["config_precisions"] = ConfigPrecisionType.FP32
    return [XnnpackPartitioner(**kwargs)]


def _int8_dynamic_quantizer(options: dict):
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    config = get_symmetric_quantization_config(is_per_channel=options["per_channel"], is_dynamic=True)
    return XNNPACKQuantizer().set_global(config)


def _duplicate_dynamic_quant_chain(graph_module) -> None:
    """Give each consumer its own dynamic quant chain, so each linear can be delegated alone."""
    from executorch.backends.transforms.duplicate_dynamic_quant_chain import (
        DuplicateDynamicQuantChainPass,
    )

    DuplicateDynamicQuantChainPass()(graph_module)


def _convert_to_linear():
    from executorch.backends.xnnpack._passes.convert_to_linear import ConvertToLinearPass

    return ConvertToLinearPass()


@hookimpl
def llmcore_partitioners() -> list[Backend]:
    return [
        Backend(
            name=BACKEND,
            description="XNNPACK: optimised CPU kernels for Arm and x86 (fp32, int8, int4 weights)",
            partitioners=_partitioners,
            edge=EdgeSettings(check_ir_validity=False),
            runtime_id="XnnpackBackend",
            runs_on="any CPU (Android, iOS, Linux, macOS, Windows)",
            options={
                "per_op_mode": (bool, False, "one delegate per operator instead of the largest subgraphs"),
                "fp32_only": (bool, False, "delegate only fp32 operators, leave quantized ones to the portable runtime"),
            },
        )
    ]


@hookimpl
def llmcore_quantizers() -> list[QuantizerRecipe]:
    return [
        QuantizerRecipe(
            name="int8-dynamic",
            description="int8 weights (symmetric, per channel) and dynamically quantized int8 activations",
            backends=(BACKEND,),
            pt2e_quantizer=_int8_dynamic_quantizer,
            after_convert=_duplicate_dynamic_quant_chain,
            options={"per_channel": (bool, True, "per-channel weight scales (else per tensor)")},
        )
    ]


@hookimpl
def llmcore_post_passes() -> list[PostPass]:
    return [
        PostPass(
            name="convert-to-linear",
            description="fuse permute + mm/addmm left outside delegates back into linear",
            create=_convert_to_linear,
            backends=(BACKEND,),
        )
    ]
