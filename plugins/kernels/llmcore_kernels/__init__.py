"""llmcore-kernels: custom ExecuTorch kernels for llmcore models.

Provides

* the runtime library ``llmcore_kernels``: the kernels, written against the ExecuTorch
  runtime headers of the executorch wheel and built by the project's CMake
  (``make runner``) into ``build/libllmcore_kernels.so`` (ExecuTorch registration) and
  ``build/libllmcore_kernels_aot.so`` (PyTorch registration);
* the source transform ``fused-rmsnorm`` (``--transforms fused-rmsnorm``): Llama-style
  RMSNorm modules become one call of ``llmcore::rms_norm``;
* the quantizer recipe ``8da4w-mlp`` (``--quantize 8da4w-mlp``): llmcore-xnnpack's ``8da4w``,
  with each SwiGLU MLP then run by ``llmcore::int4_mlp``, llmcore's own int4 kernel;
* the quantizer recipes ``8da4w-layers``, ``gguf-layers`` and ``8da8w-layers``: 8da4w's
  integers, a GGUF's own, or 8da8w's int8 ones, with each whole Llama layer run by
  ``llmcore::int4_norm_qkv_rope``, ``llmcore::int4_linear_add`` and ``llmcore::int4_norm_mlp_add``,
  the final norm by ``llmcore::rms_norm`` and the output layer by ``llmcore::int4_linear``
  (:mod:`llmcore_kernels.layers`; the operators take int4 blocks and int8 rows); Gemma's
  layers (sandwich norms, GeGLU) end in ``llmcore::int4_linear_norm_add`` and
  ``llmcore::int4_norm_glu_add`` instead; GPT-2's (LayerNorms and biases, a plain GELU MLP)
  run on ``llmcore::int4_layer_norm_linear``, ``llmcore::int4_linear_bias_add`` and
  ``llmcore::int4_layer_norm_ffn_add`` (:mod:`llmcore_kernels.layernorm_layers`).

See ``docs/custom-kernels.md`` for how this plugin is put together.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from llmcore import hookimpl
from llmcore.errors import LlmcoreError
from llmcore.records import Backend, EdgeSettings, Lazy, QuantizerRecipe, RuntimeLibrary, SourceTransform

from llmcore_kernels import library

__version__ = "0.1.0"

# Runtime operator names the native library registers (kept here, not in .ops, so that
# listing plugins does not load the library).
OPS = ("llmcore::rms_norm.out", "llmcore::int4_mlp.out", "llmcore::int4_norm_qkv_rope.out",
       "llmcore::int4_norm_qkv_norm_rope.out",
       "llmcore::int4_linear_add.out", "llmcore::int4_norm_mlp_add.out", "llmcore::int4_linear.out",
       "llmcore::int4_linear_norm_add.out", "llmcore::int4_norm_glu_add.out", "llmcore::int4_linear_bias_add.out",
       "llmcore::int4_layer_norm_linear.out", "llmcore::int4_layer_norm_ffn_add.out", "llmcore::q6_k_embedding.out")


def _threads_for_program(delegates: tuple[str, ...]) -> None:
    """The kernels on their own threads in a program with no delegate (all its heavy work is
    theirs: 8da4w-layers), on ExecuTorch's pool in one with delegates, whose worker they then
    share, until one of their whole-layer operators runs and moves them to their own
    (runtime/kernels/kernel_threads.h, kernel_threads_for_whole_layers), as in llmcore_runner."""
    library.use_own_threads(not delegates)


BACKEND = "kernels"


def _no_partitioners(options: dict) -> list:
    return []  # the kernels are in the graph before it is captured (takes_modules), not delegated


@hookimpl
def llmcore_partitioners() -> list[Backend]:
    """``kernels``: llmcore's whole-layer int4/int8 operators as a backend, listed before the
    one that runs what they leave (``--plugins kernels,xnnpack``, the default list of a
    quantized CPU export): they take each layer they compute exactly, after the recipe has
    chosen the integers (:mod:`llmcore_kernels.backend`)."""
    return [
        Backend(
            name=BACKEND,
            description="llmcore's own CPU kernels: each quantized layer (int4 blocks of 32 or int8 rows) on "
            "three fused operators, the final norm and output layer too, ahead of XNNPACK, which gets what "
            "they cannot run (the reasons are in the export's summary); needs the llmcore_kernels runtime "
            "library",
            partitioners=_no_partitioners,
            edge=EdgeSettings(check_ir_validity=False),  # llmcore:: operators are not core ATen
            runs_on="any x86-64 CPU (AVX2, AVX-512 VNNI, or portable loops) with the llmcore_kernels library",
            takes_modules=Lazy("llmcore_kernels.backend", "take"),
            default_order=10,  # ahead of XNNPACK (20) in a CPU export's default list
            # the operators take one int8 row per token: without the outlier split 8da8w's
            # layers are theirs (8da8w-layers' quality: docs/performance.md, "int8 rows on the
            # layer operators")
            # int4 layers two to a byte until taken: an 8B's export fits; a tied table stored once,
            # the output layer's int8 rows read in place by llmcore::int4_linear and looked up by the
            # embedding (Llama-3.2-1B's program 1058 -> 776 MiB), or a GGUF's Q8_0 table's blocks
            # read so by both (int8 blocks: SmolLM2's program 128.7 -> 101.5 MiB); an output layer
            # stored as Q6_K (a Q4_K_M file's) as the file's super-blocks, and its tied table's
            # lookups in them; Q4_K linears as the file's integers and super-block headers (the
            # exact values in the file's 4.5 bits a weight, not bfloat16 scales and float16 offsets)
            recipe_defaults={"8da8w": {"outlier_split": False},
                             "gguf": {"int4_nibbles": True, "tied_table": True, "q6_k_output": True,
                                      "q4_k_headers": True},
                             "8da4w": {"int4_nibbles": True, "tied_table": True}},
        )
    ]


@hookimpl
def llmcore_runtime_libraries() -> list[RuntimeLibrary]:
    return [
        RuntimeLibrary(
            name="llmcore_kernels",
            description="fused RMSNorm (llmcore::rms_norm.out) and the int4 SwiGLU MLP (llmcore::int4_mlp.out), "
            "C++ against the ExecuTorch runtime headers",
            ops=OPS,
            python_module="llmcore_kernels.ops",
            shared_library=library.runtime_library,
            prepare=_threads_for_program,
        ),
        RuntimeLibrary(
            name="llmcore_xnnpack_reshape",
            description="XNNPACK's whole-runtime reshape only when a delegate's input shapes changed, as in "
            "llmcore_runner: ExecuTorch's delegate asks for one on every call, a share of every decode "
            "step (docs/performance.md); LLMCORE_XNNPACK_RESHAPE=always turns it off",
            ops=(),
            shared_library=library.xnnpack_reshape_library,
            declared=False,
            preload=True,
        ),
    ]


@hookimpl
def llmcore_source_transforms() -> list[SourceTransform]:
    return [
        SourceTransform(
            name="fused-rmsnorm",
            description="swap Llama-style RMSNorm modules for the fused llmcore::rms_norm kernel "
            "(programs then need the llmcore_kernels runtime library)",
            apply=Lazy("llmcore_kernels.rmsnorm", "apply"),
            order=60,
        )
    ]


# What llmcore's int4 kernel takes: symmetric int4 blocks of 32 (the layer operators also
# blocks with offsets), one int8 row per token.
_MLP_KERNEL_OPTIONS = {"group_size": 32, "asymmetric": False, "outlier_split": False}
_LAYER_KERNEL_OPTIONS = {"group_size": 32, "outlier_split": False}


def _quantize_then(base: str, recipe: str, swap, kernel_options: dict):
    """A source-quantize function: llmcore-xnnpack's recipe ``base`` (8da4w, 8da8w) with the
    options the kernel takes, then ``swap`` (the module, quantized) hands parts of the model to
    llmcore's kernels."""

    def source_quantize(module, options: dict, calibration):
        from llmcore_xnnpack import recipes

        _check_kernel_options(recipe, options, kernel_options)
        return swap(getattr(recipes, f"quantize_{base}")(module, options, calibration))

    return source_quantize


def _check_kernel_options(recipe: str, options: dict, kernel_options: dict) -> None:
    for option, value in kernel_options.items():
        if options[option] != value:
            raise LlmcoreError(
                f"{recipe}: {option}={options[option]} gives linears that llmcore's kernels cannot run "
                f"(it takes {option}={value}).",
                stage="quantize",
                fix=f"drop {option} from --quantize-options, or use --quantize {recipe.rsplit('-', 1)[0]}.",
            )


def _quantize_gguf_layers(module, options: dict):
    from llmcore_xnnpack.recipes import quantize_gguf

    _check_kernel_options("gguf-layers", options, {"outlier_split": False})
    from llmcore_kernels import layers

    return layers.apply(quantize_gguf(module, options), "gguf-layers", "gguf")


# layers.apply(module, recipe, instead): the *-layers recipes' swap, each with its own names
_SWAP_LAYERS = Lazy("llmcore_kernels.layers", "apply")


@hookimpl
def llmcore_quantizers() -> list[QuantizerRecipe]:
    """``8da4w-mlp``, ``8da4w-layers``, ``gguf-layers`` and ``8da8w-layers``: llmcore-xnnpack's
    ``8da4w``, ``gguf`` and ``8da8w`` records with their options and calibration, the MLPs (or
    whole layers) then handed to llmcore's kernels."""
    from llmcore_xnnpack import llmcore_quantizers as xnnpack_recipes

    base = {r.name: r for r in xnnpack_recipes()}
    return [
        dataclasses.replace(
            base["8da4w"],
            name="8da4w-mlp",
            description="8da4w (llmcore-xnnpack's recipe, the same integers), each SwiGLU MLP then run by "
            "llmcore::int4_mlp: gate, up and down in one operator on llmcore's own int4 kernel "
            "(vpmaddubsw on AVX2, vpdpbusd with AVX-512 VNNI), the rest by XNNPACK; for models whose "
            "attention 8da4w-layers refuses; needs the llmcore_kernels runtime library",
            source_quantize=_quantize_then("8da4w", "8da4w-mlp", Lazy("llmcore_kernels.mlp", "apply"),
                                           _MLP_KERNEL_OPTIONS),
        ),
        dataclasses.replace(
            base["8da4w"],
            name="8da4w-layers",
            description="8da4w (the same integers), each Llama layer's norms, projections, RoPE, MLP and "
            "residual adds then run by three llmcore operators on llmcore's own int4 kernel, no XNNPACK "
            "delegate in the program (the final norm and the output layer on the same kernels): faster than "
            "8da4w on AVX2, and at decode where XNNPACK has VNNI; needs the llmcore_kernels runtime library",
            source_quantize=_quantize_then(
                "8da4w", "8da4w-layers", partial(_SWAP_LAYERS, recipe="8da4w-layers", instead="8da4w-mlp or 8da4w"),
                _LAYER_KERNEL_OPTIONS,
            ),
        ),
        dataclasses.replace(
            base["gguf"],
            name="gguf-layers",
            description="gguf (a quantized GGUF's own integers, Q4_1/Q4_K minima as per-block offsets), each "
            "Llama layer then on llmcore's int4 layer operators as in 8da4w-layers: the file's quality at "
            "the kernels' speed; every layer's linears must be 4-bit in the file; needs the "
            "llmcore_kernels runtime library",
            source_quantize=_quantize_gguf_layers,
            checkpoint_default=False,  # gguf stays the default for a quantized GGUF
        ),
        dataclasses.replace(
            base["8da8w"],
            name="8da8w-layers",
            description="8da8w without the outlier split (int8 weights per channel, activation-aware and AWQ "
            "scales, one int8 row per token), each Llama layer then on llmcore's layer operators as in "
            "8da4w-layers, their int8 GEMM (vpmaddwd on AVX2, vpdpbusd with VNNI) reading each thread's "
            "rows as one stream, the output layer too; needs the llmcore_kernels runtime library",
            source_quantize=_quantize_then(
                "8da8w", "8da8w-layers", partial(_SWAP_LAYERS, recipe="8da8w-layers", instead="8da8w"),
                {"outlier_split": False},
            ),
            # the kernels take one int8 row per token: the split is off here, and refused when asked for
            options=base["8da8w"].options | {"outlier_split": (bool, False, "must stay false: llmcore's kernels "
                                                              "take one int8 row per token")},
        ),
    ]
