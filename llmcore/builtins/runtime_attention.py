"""The runtime's own attention library, ``libllmcore_llm_ops.so``, and the ops only it
runs: ``llmcore::softcap_sdpa``, the KV cache's attention with soft-capped scores (Gemma 2),
and ``llmcore::quantize_rows``, an int8 cache's per-row rounding.

No fused attention kernel caps scores (``llama::custom_sdpa`` has no cap), so a Gemma 2
program used to write its attention out: matmuls, ``tanh`` and a softmax over the whole
cache in the graph, every decode step reading every row of it (0.67x llama.cpp's decode at
SmolLM2's shape, docs/performance.md). This op is ``llama::custom_sdpa`` with each score
``s`` replaced by ``softcap * tanh(s / softcap)`` before the mask is added:

    llmcore::softcap_sdpa(Tensor query, Tensor key, Tensor value, SymInt start_pos,
                          Tensor? attn_mask, float? scale, float softcap) -> Tensor

``query`` ``[B, T, H, D]``, ``key``/``value`` the cache ``[B, S, H_kv, D]`` (float32,
float16 or bfloat16, all one type; 16-bit calls compute in float32). Without a mask the
query at ``start_pos + t`` sees keys ``[0, start_pos + t]``; with an additive ``[T, S]``
float32 mask (0 / -inf: sliding windows, ring buffers) it sees what the mask lets it and
``start_pos`` is not read. ``scale`` defaults to ``1/sqrt(D)``.

Its run-time kernel is the runtime's own (``runtime/kernels/llm_ops.cpp``, the attention
kernel of ``llama::custom_sdpa`` with the cap): ``llmcore_runner`` links it, and a Python
process loads it from ``libllmcore_llm_ops.so`` in the build folder (``make runner``), the
runtime library declared below (the kernels plugin loads the same file for its faster
``llama::custom_sdpa`` kernels: :func:`llmcore.runtime.libraries.llm_ops_library` is where
both find it). Its PyTorch kernel here is the same arithmetic written out
(:func:`llmcore.modules.explicit_attention`), for eager runs, the parity reference and
``torch.export``. Where the library is not built the KV-cache transform keeps the written-out
attention (:func:`kernel_built`): a program it made must run in the process that checks it.

    llmcore::quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)

``x`` ``[..., D]`` float32 as int8 with a float32 scale and an int8 zero point per row of
``D`` (``[..., 1]`` each): PyTorch's ``quantized_decomposed.choose_qparams_per_token_asymmetric``
and ``quantize_per_token``, which an int8 cache (``--kv-cache-dtype int8``) rounds its new
keys and values and its queries with, bit for bit. In a program those two ops decompose into
some twenty portable operators a call, three calls a layer: SmolLM2's int8-cache program had
1437 operator nodes where the fp32 cache's had 657 (docs/performance.md, "The KV cache's
element type", has what each cost). Its run-time kernel is in the same
library; its PyTorch kernel is those two ops. Where the library is not built the cache rounds
with them directly, as before.
"""

from __future__ import annotations

from typing import Optional

from llmcore.hookspecs import hookimpl
from llmcore.records import RuntimeLibrary
from llmcore.runtime import libraries

OP = "llmcore::softcap_sdpa"
QUANTIZE_OP = "llmcore::quantize_rows"
RUNTIME_OPS = (f"{OP}.out", f"{QUANTIZE_OP}.out")
# the module whose import registers torch.ops.quantized_decomposed.* (quantize_rows' arithmetic)
QUANTIZED_DECOMPOSED_MODULE = "torch.ao.quantization.fx._decomposed"

_SCHEMA = ("Tensor query, Tensor key, Tensor value, SymInt start_pos, Tensor? attn_mask, float? scale, "
           "float softcap")
_defined = []  # the torch.library.Library that holds the definitions, once made


def kernel_built() -> bool:
    """Whether this process can run the op in a program (the library is built)."""
    return libraries.llm_ops_built()


def softcap_sdpa(q, k, v, start_pos: int, attn_mask, scale: Optional[float], softcap: float):
    """The op's arithmetic in PyTorch (``[B, T, H, D]`` out, ``q``'s type), float32 inside."""
    import torch

    from llmcore.modules import attention_mask, explicit_attention

    seq_len = q.shape[1]
    if attn_mask is None:  # causal from start_pos, over the rows written so far
        end = start_pos + seq_len
        k, v = k[:, :end], v[:, :end]
        attn_mask = attention_mask(torch.arange(start_pos, end), torch.arange(end), None)
    y = explicit_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask, scale, softcap)
    return y.transpose(1, 2).contiguous().to(q.dtype)


def quantize_rows(x):
    """The op's arithmetic in PyTorch: ``(int8 rows, float32 scales, int8 zero points)``."""
    import importlib

    import torch

    importlib.import_module(QUANTIZED_DECOMPOSED_MODULE)
    ops = torch.ops.quantized_decomposed
    scales, zero_points = ops.choose_qparams_per_token_asymmetric.default(x, torch.int8)
    rounded = ops.quantize_per_token(x, scales, zero_points, -128, 127, torch.int8)
    return rounded, scales.float(), zero_points.to(torch.int8)


def define() -> None:
    """Define ``torch.ops.llmcore.softcap_sdpa`` and ``torch.ops.llmcore.quantize_rows`` (and
    their ``.out``, which ExecuTorch's emitter calls) for PyTorch, once per process."""
    if _defined:
        return
    import torch

    lib = torch.library.Library("llmcore", "FRAGMENT")  # the kernels plugin defines more of llmcore::
    lib.define(f"softcap_sdpa({_SCHEMA}) -> Tensor")
    lib.define(f"softcap_sdpa.out({_SCHEMA}, *, Tensor(a!) out) -> Tensor(a!)")

    def functional(q, k, v, start_pos, attn_mask, scale, softcap):
        return softcap_sdpa(q, k, v, start_pos, attn_mask, scale, softcap)

    def out_variant(q, k, v, start_pos, attn_mask, scale, softcap, *, out):
        y = softcap_sdpa(q, k, v, start_pos, attn_mask, scale, softcap)
        out.resize_(y.shape).copy_(y)
        return out

    lib.impl("softcap_sdpa", functional, "CPU")
    lib.impl("softcap_sdpa.out", out_variant, "CPU")
    torch.library.register_fake("llmcore::softcap_sdpa", lambda q, *_: torch.empty_like(q), lib=lib)

    lib.define("quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)")
    lib.define("quantize_rows.out(Tensor x, *, Tensor(a!) q, Tensor(b!) scales, Tensor(c!) zero_points) -> "
               "(Tensor(a!), Tensor(b!), Tensor(c!))")

    def quantize_rows_out(x, *, q, scales, zero_points):
        for out, value in zip((q, scales, zero_points), quantize_rows(x)):
            out.resize_(value.shape).copy_(value)
        return q, scales, zero_points

    def quantize_rows_fake(x):
        rows = (*x.shape[:-1], 1)
        return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(rows), x.new_empty(rows, dtype=torch.int8)

    lib.impl("quantize_rows", quantize_rows, "CPU")
    lib.impl("quantize_rows.out", quantize_rows_out, "CPU")
    torch.library.register_fake(QUANTIZE_OP, quantize_rows_fake, lib=lib)
    _defined.append(lib)


# ExecuTorch's attention ops whose calls libllmcore_llm_ops.so takes over in Python processes,
# under ExecuTorch kernel keys (float32, float16, bfloat16 custom_sdpa; int8 custom_quantized_sdpa)
SPECIALIZED_OPS = ("llama::custom_sdpa.out", "llama::custom_quantized_sdpa.out")


@hookimpl
def llmcore_runtime_libraries() -> list[RuntimeLibrary]:
    return [
        RuntimeLibrary(
            name="llmcore_attention",
            description="the runtime's attention kernel with soft-capped scores (llmcore::softcap_sdpa: Gemma 2) "
            "and an int8 cache's rounding (llmcore::quantize_rows), "
            f"from {libraries.LLM_OPS_LIBRARY} (make runner); llmcore_runner links it",
            ops=RUNTIME_OPS,
            shared_library=libraries.llm_ops_library,
            declared=False,  # llmcore_runner links it: nothing for a runner to look for
        ),
        RuntimeLibrary(
            name="llmcore_llm_ops",
            description="llmcore_runner's attention kernels for ExecuTorch's llama::custom_sdpa (float32, float16, "
            "bfloat16) and llama::custom_quantized_sdpa (int8) calls, in Python processes too: without them they "
            "run ExecuTorch's, whose decode steps spend a third of their time in MKL's matrix-vector products "
            "at long contexts, and whose int8 attention decoded SmolLM2 at a quarter of the runner's speed "
            "(docs/performance.md)",
            ops=SPECIALIZED_OPS,
            shared_library=libraries.llm_ops_library,
            declared=False,
            specialized=True,
        ),
    ]
