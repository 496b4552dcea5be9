"""XNNPACK for llmcore: the CPU backend that runs everywhere ExecuTorch does.

Provides the ``xnnpack`` backend (its partitioners and edge settings), the
``int8-dynamic`` (pt2e), ``8da4w`` and ``gguf`` (source level, :mod:`llmcore_xnnpack.recipes`)
quantizer recipes, and the
post-pass that turns leftover ``permute + mm`` pairs back into ``linear``. By default the
partitioner stores a table tied between the token embedding and an fp32 output layer once
(see :mod:`llmcore_xnnpack.partition`). ExecuTorch's XNNPACK modules and torchao are
imported only inside the factories.
"""

from __future__ import annotations

from llmcore import hookimpl
from llmcore.records import Backend, EdgeSettings, Lazy, PostPass, QuantizerRecipe, SourceTransform

__version__ = "0.1.0"

BACKEND = "xnnpack"


def _while_lowering(options: dict):
    from llmcore_xnnpack.lowering import while_lowering

    return while_lowering()


_CALIBRATION_TEXT_OPTION = (
    str,
    "",
    "the UTF-8 text file activation_aware reads (empty: llmcore's built-in ~350 words; a few "
    "hundred tokens of the kind of text the model will see are enough)",
)


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


def _per_token_reference(converted):
    from llmcore_xnnpack.dynamic_quant import lean_weight_dequantize, per_token_activations

    return lean_weight_dequantize(per_token_activations(converted))


# ConvertToLinearPass's ``targets``: it rewrites [add]mm and bmm nodes (and the permutes
# that feed them) into linear; tests/test_xnnpack_post_passes.py checks the names against
# the pass.
CONVERT_TO_LINEAR_REWRITES = ("aten::mm", "aten::addmm", "aten::bmm")


@hookimpl
def llmcore_partitioners() -> list[Backend]:
    return [
        Backend(
            name=BACKEND,
            description="XNNPACK: optimised CPU kernels for Arm and x86 (fp32, int8, int4 weights)",
            partitioners=Lazy("llmcore_xnnpack.partition", "partitioners"),
            edge=EdgeSettings(check_ir_validity=False),
            runtime_id="XnnpackBackend",
            runs_on="any CPU (Android, iOS, Linux, macOS, Windows)",
            while_lowering=_while_lowering,
            upstream_patches=Lazy("llmcore_xnnpack.lowering", "upstream_patches"),
            default_order=20,  # in a CPU export's default list, after backends that run whole layers
            options={
                "per_op_mode": (bool, False, "one delegate per operator instead of the largest subgraphs"),
                "fp32_only": (bool, False, "delegate only fp32 operators, leave quantized ones to the portable runtime"),
                "share_tied_weights": (
                    bool,
                    True,
                    "store a table shared by the embedding and an fp32 output layer once: the output layer "
                    "runs in the runtime's linear kernel instead of XNNPACK, which would keep its own copy "
                    "(a larger file: plugins/xnnpack/README.md); false restores ExecuTorch's default",
                ),
            },
        )
    ]


def _embedding_options(default_bits: int) -> dict:
    return {
        "embedding_bits": (int, default_bits, "quantize embedding tables too: 8 or 4 bits (0 = keep fp32)"),
        "embedding_group_size": (int, 32, "columns per embedding scale (0 = one per row)"),
    }


_TIED_TABLE_OPTION = (
    bool,
    False,
    "an embedding tied to the output layer, which the recipe rounds to int8 per channel, looks its rows "
    "up in that layer's integers (one scale a row), and a GGUF's tied Q8_0 table stays as the file holds it "
    "for both (gguf; only llmcore-kernels computes that layer): the program holds the table once, as the "
    "checkpoint does, where the output layer runs on those integers in place (llmcore-kernels asks for it); "
    "XNNPACK packs a copy of its own, so with XNNPACK alone the embedding keeps a table of its own (false)",
)

_INT4_NIBBLES_OPTION = (
    bool,
    False,
    "hold the int4 layers' integers two to a byte until a backend that runs int4 itself takes "
    "them (half their memory during the export of a large model; llmcore-kernels asks for it "
    "and unpacks what it leaves to XNNPACK)",
)


def _outlier_split_option(default: bool) -> tuple:
    return (
        bool,
        default,
        "run each GEMM on two int8 rows per token, the token clamped to 1/8 of its largest value and the "
        "clamped-off outliers (false: one row): less KL divergence from the float model, for slower "
        "decode and prefill (docs/quantization.md)",
    )


@hookimpl
def llmcore_quantizers() -> list[QuantizerRecipe]:
    return [
        QuantizerRecipe(
            name="int8-dynamic",
            description="int8 weights (symmetric, per channel) and dynamically quantized int8 activations",
            backends=(BACKEND,),
            pt2e_quantizer=_int8_dynamic_quantizer,
            after_convert=_duplicate_dynamic_quant_chain,
            parity_reference=_per_token_reference,
            options={"per_channel": (bool, True, "per-channel weight scales (else per tensor)")},
        ),
        QuantizerRecipe(
            name="8da4w",
            description=(
                "int4 weights (symmetric, per group) with int8 activations quantized per token at run time, "
                "for every linear layer, run by XNNPACK; the output layer at int8 per channel unless "
                "output_bits=4; embedding tables as int8 rows (embedding_bits=4: int4, 0: fp32), run by the "
                "runtime's quantized embedding kernels (the file sizes: plugins/xnnpack/README.md)"
            ),
            backends=(BACKEND,),
            source_quantize=Lazy("llmcore_xnnpack.recipes", "quantize_8da4w"),
            calibrated=True,
            options={
                "group_size": (
                    int,
                    32,
                    "in-features per int4 scale: a multiple of 32 (0 = one per output channel); a layer it "
                    "does not divide gets the largest multiple of 32 that does, one whose in-features are "
                    "not a multiple of 32 stays fp32",
                ),
                **_embedding_options(8),  # int8 tables by default: smaller, same perplexity (docs/quantization.md)
                "activation_aware": (
                    bool,
                    True,
                    "choose each symmetric int4 scale for the output error it causes, weighting every input "
                    "feature by its mean square on calibration text (false: hqq's choice); lowers the mean KL "
                    "divergence from the float model (docs/quantization.md)",
                ),
                "awq": (
                    bool,
                    True,
                    "scale each linear's input channels before rounding (AWQ), folded into the norm or "
                    "projection before it, the scales searched on calibration text for the least output "
                    "error; models that list no foldable channels get none. Symmetric blocks only. Lowers "
                    "the mean KL divergence from the float model (docs/quantization.md)",
                ),
                "calibration_text": _CALIBRATION_TEXT_OPTION,
                "hqq": (
                    bool,
                    True,
                    "choose int4 scales with HQQ's scale search (false: min/max): int4 embeddings always, "
                    "linears when activation_aware=false; less loss than min/max's scales "
                    "(docs/quantization.md)",
                ),
                "asymmetric": (
                    bool,
                    False,
                    "give each int4 block a minimum as well as a scale (Q4_1's form, fitted by least squares; "
                    "hqq applies to symmetric blocks only), run as the symmetric GEMM plus a per-block offset "
                    "term: lower loss, slower decode (docs/quantization.md)",
                ),
                "output_bits": (int, 8, "bits of the output layer (tied or not): 8 (per channel) or 4"),
                "tied_table": _TIED_TABLE_OPTION,
                "outlier_split": _outlier_split_option(False),
                "int4_nibbles": _INT4_NIBBLES_OPTION,
            },
            reads_weights_in_file=True,
        ),
        QuantizerRecipe(
            name="8da8w",
            description=(
                "int8 weights (symmetric, per output channel, activation-aware scales) for every linear layer, "
                "int8 activations per token with the outliers on a second row (outlier_split), run by XNNPACK: "
                "the quality-first recipe (docs/quantization.md); "
                "embeddings stay fp32 unless embedding_bits=8 or 4"
            ),
            backends=(BACKEND,),
            source_quantize=Lazy("llmcore_xnnpack.recipes", "quantize_8da8w"),
            calibrated=True,
            options={
                **_embedding_options(0),
                "activation_aware": (
                    bool,
                    True,
                    "choose each channel's int8 scale for the output error it causes, weighting every input "
                    "feature by its mean square on calibration text (false: min/max); lowers the mean KL "
                    "divergence from the float model (docs/quantization.md)",
                ),
                "awq": (
                    bool,
                    True,
                    "scale each linear's input channels before rounding (AWQ, as 8da4w's awq); lowers the "
                    "mean KL divergence from the float model (docs/quantization.md)",
                ),
                "calibration_text": _CALIBRATION_TEXT_OPTION,
                "outlier_split": _outlier_split_option(True),
            },
            reads_weights_in_file=True,
        ),
        QuantizerRecipe(
            name="gguf",
            description=(
                "a quantized GGUF's own integers and scales, unchanged: Q4_0, Q4_1 and Q4_K linears as int4 "
                "(Q4_1/Q4_K minima as a per-block offset term), int8 activations per token, run by XNNPACK; "
                "other quantized types rounded to int8 per channel, with the error printed. The default "
                "for a quantized GGUF exported with --plugins xnnpack"
            ),
            backends=(BACKEND,),
            source_quantize=Lazy("llmcore_xnnpack.recipes", "quantize_gguf"),
            for_quantized_checkpoints=True,
            options={
                "outlier_split": _outlier_split_option(False),
                "int4_nibbles": _INT4_NIBBLES_OPTION,
                "tied_table": _TIED_TABLE_OPTION,
                "q6_k_output": (
                    bool,
                    False,
                    "an output layer the GGUF stores as Q6_K (a Q4_K_M file's), and the token table tied to it, "
                    "keep the file's super-blocks as they are: 6.56 bits a weight and the file's values, where "
                    "int8 per channel takes 8 and rounds them again; only llmcore-kernels computes them (it "
                    "asks for it), so with XNNPACK alone the layer is rounded to int8 per channel (false)",
                ),
                "q4_k_headers": (
                    bool,
                    False,
                    "int4 linears the GGUF stores as Q4_K (most of a Q4_K_M file's) also keep their super-blocks' "
                    "headers as the file holds them (a float16 scale and minimum and 6-bit codes a block): "
                    "llmcore-kernels computes those exact values (it asks for it), 4.5 bits a weight as the file; "
                    "XNNPACK takes bfloat16 scales and float16 offsets (5 bits), and drops them",
                ),
            },
        ),
    ]


@hookimpl
def llmcore_post_passes() -> list[PostPass]:
    return [
        PostPass(
            name="convert-to-linear",
            description="fuse permute + mm/addmm left outside delegates back into linear",
            create=Lazy("executorch.backends.xnnpack._passes.convert_to_linear", "ConvertToLinearPass"),
            backends=(BACKEND,),
            rewrites=CONVERT_TO_LINEAR_REWRITES,
        )
    ]


def _xnnpack_first(context) -> bool:
    return context.first_backend == "xnnpack"


@hookimpl
def llmcore_source_transforms() -> list[SourceTransform]:
    return [
        SourceTransform(
            name="xnnpack-norms",
            description="RMSNorm / LayerNorm with their means as 4-D global pools, which XNNPACK "
            "delegates (same values); when XNNPACK is the first backend",
            apply=Lazy("llmcore_xnnpack.norms", "apply"),
            order=20,
            backends=("xnnpack",),
            automatic=True,
            applies=_xnnpack_first,
        )
    ]
