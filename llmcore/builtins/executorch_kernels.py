"""ExecuTorch's own kernel libraries, as runtime libraries like any plugin's.

The KV-cache transform's ``llama::`` attention and cache ops and the quantized kernels that
quantized programs call outside their delegates (``quantized_decomposed::``: 4-bit and
byte embeddings, per-token (de)quantization) live in libraries that the ``executorch``
wheel registers with the runtime only when their Python modules are imported. Declared here
as :class:`~llmcore.records.RuntimeLibrary` records, they are found the way every custom
operator library is: from the operators a program calls (:mod:`llmcore.runtime.libraries`), loaded
before it runs (the parity check, ``llmcore run``, ``profile``, ``eval``, ``inspect``) and
listed in the export report. They are not named in a program's ``get_runtime_libraries``
(``declared=False``): ``llmcore_runner`` links both.

The operator lists are what importing each module adds to the runtime's registry
(``executorch 1.5.1``); ``tests/test_runtime_libraries.py`` checks them against the
installed wheel.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llmcore.errors import LlmcoreError
from llmcore.hookspecs import hookimpl
from llmcore.records import RuntimeLibrary

LLM_CUSTOM_OPS_MODULE = "executorch.extension.llm.custom_ops.custom_ops"
QUANTIZED_KERNELS_MODULE = "executorch.kernels.quantized"

LLM_CUSTOM_OPS = (
    "llama::channelwise_gated_delta_rule.out", "llama::custom_quantized_sdpa.out", "llama::custom_sdpa.out",
    "llama::fallback.out", "llama::fast_hadamard_transform.out", "llama::gated_delta_rule.out",
    "llama::quantized_moe_ffn.out", "llama::sdpa_with_kv_cache.out", "llama::update_cache.out",
    "llama::update_cache_with_indices.out", "preprocess::tile_crop.out",
)
QUANTIZED_OPS = (
    "quantized_decomposed::add.out", "quantized_decomposed::choose_qparams.Tensor_out",
    "quantized_decomposed::choose_qparams_per_token_asymmetric.out", "quantized_decomposed::dequantize_per_channel.out",
    "quantized_decomposed::dequantize_per_tensor.Tensor_out", "quantized_decomposed::dequantize_per_tensor.out",
    "quantized_decomposed::dequantize_per_token.out", "quantized_decomposed::embedding_2bit.dtype_out",
    "quantized_decomposed::embedding_2bit.out", "quantized_decomposed::embedding_4bit.dtype_out",
    "quantized_decomposed::embedding_4bit.out", "quantized_decomposed::embedding_byte.dtype_out",
    "quantized_decomposed::embedding_byte.out", "quantized_decomposed::mixed_linear.out",
    "quantized_decomposed::mixed_mm.out", "quantized_decomposed::quantize_per_channel.out",
    "quantized_decomposed::quantize_per_tensor.Tensor_out", "quantized_decomposed::quantize_per_tensor.out",
    "quantized_decomposed::quantize_per_token.out",
)


def llm_custom_ops_library() -> Path:
    """The native library that importing the LLM custom ops' module loads (its PyTorch and
    ExecuTorch kernels), found as the module finds it, in its package's folder, without
    importing the module (it imports ExecuTorch's compiler)."""
    spec = importlib.util.find_spec(LLM_CUSTOM_OPS_MODULE.rsplit(".", 1)[0])  # imports the parent packages only
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    found = sorted(p for folder in folders for p in Path(folder).glob("**/*custom_ops_aot_lib.*"))
    if len(found) != 1:
        raise LlmcoreError(
            f"expected one custom_ops_aot_lib library in the executorch wheel's {folders}, found {len(found)}.",
            stage="run",
            fix="reinstall the executorch wheel this llmcore pins.",
        )
    return found[0]


@hookimpl
def llmcore_runtime_libraries() -> list[RuntimeLibrary]:
    return [
        RuntimeLibrary(
            name="executorch_llm_custom_ops",
            description="ExecuTorch's LLM custom ops (llama::custom_sdpa, llama::update_cache, ...): the KV cache's "
            "attention and cache updates",
            ops=LLM_CUSTOM_OPS,
            python_module=LLM_CUSTOM_OPS_MODULE,
            module_library=llm_custom_ops_library,
            declared=False,
        ),
        RuntimeLibrary(
            name="executorch_quantized_kernels",
            description="ExecuTorch's quantized kernels (quantized_decomposed::embedding_4bit, per-token "
            "(de)quantization, ...), called outside delegates by quantized programs",
            ops=QUANTIZED_OPS,
            python_module=QUANTIZED_KERNELS_MODULE,
            declared=False,
        ),
    ]
