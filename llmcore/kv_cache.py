"""The KV-cache attention forms: the part of the core's KV cache a backend plugin may rely on.

llmcore's ``kv-cache`` transform (on by default) and ``kv-cache-static`` (``--transforms
kv-cache-static``) swap every :class:`llmcore.modules.CausalAttention` for a cached
attention module, one form each, described by a :class:`~llmcore.records.KVCacheForm`
record: its class, the layout of its cache buffers, the ExecuTorch custom ops it calls, and
(:data:`~llmcore.records.KV_CACHE_ATTRIBUTES`) the attributes every form has. A backend's
own source transform, ordered after them, finds these modules and swaps them for its own
(Core ML's and QNN's caches) or refuses one it cannot run (Vulkan and the plain-PyTorch
cache); it imports what it needs from here, never from ``llmcore.builtins`` (the core's
implementation, which may change; ``tests/test_kv_cache_forms.py`` checks every plugin)::

    from llmcore.kv_cache import CustomOpKVAttention
    from llmcore.modules import replace_modules
    from llmcore.records import Transformed
    import dataclasses

    def my_attention(module, context):
        swapped = replace_modules(module, CustomOpKVAttention,
                                  lambda a: MyCachedAttention(a.n_heads, a.n_kv_heads, a.head_dim, a.capacity))
        if not swapped:
            return module
        # the program no longer calls llama::custom_sdpa
        return Transformed(module, dataclasses.replace(context.convention, use_sdpa_with_kv_cache=False))

Importing this module is cheap; the classes (which import torch) load when first named.
"""

from __future__ import annotations

from typing import Any

from llmcore.records import KV_CACHE_ATTRIBUTES, KVCacheForm

CUSTOM_OPS = KVCacheForm(
    name="kv-cache",
    description="static KV cache through ExecuTorch's llama::update_cache and llama::custom_sdpa (default)",
    module_class="llmcore.builtins.kv_cache:CustomOpKVAttention",
    cache_layout="[1, S, H_kv, D]",
    custom_ops=("llama::update_cache", "llama::update_cache_with_indices", "llama::custom_sdpa"),
)
"""The default cache (``kv-cache``): ExecuTorch's LLM custom ops write the new rows in place
(``update_cache``, or ``update_cache_with_indices`` for a ring buffer) and attend
(``custom_sdpa``); a layer with soft-capped scores attends with plain matmuls instead."""

STATIC = KVCacheForm(
    name="kv-cache-static",
    description="static KV cache in plain PyTorch (index_put_ + masked SDPA), for backends without the custom ops",
    module_class="llmcore.builtins.kv_cache:StaticKVAttention",
    cache_layout="[S, H_kv, D]",
)
"""The plain-PyTorch cache (``kv-cache-static``): rows written with ``index_put_`` (the written
dimension first, the in-place form ExecuTorch's runtime takes), a masked SDPA over them."""

FORMS: tuple[KVCacheForm, ...] = (CUSTOM_OPS, STATIC)

DEFAULT_CACHE_DTYPE = "fp32"
CACHE_DTYPES: dict[str, str] = {
    "fp32": "32-bit floats (the default): keys and values as the model computes them",
    "bf16": "bfloat16: half the memory of fp32; attention in bfloat16 (queries rounded to it)",
    "fp16": "float16: half the memory of fp32; attention in float16 (queries rounded to it)",
    "int8": "8-bit integers with a scale and zero point per position and head: about a quarter of fp32's "
            "memory; ExecuTorch's llama::custom_quantized_sdpa attends (queries rounded to int8 per token too)",
}
"""The element types a cache can keep (``llmcore export --kv-cache-dtype``), with what each
costs. The cache's bytes are what a decode step's attention reads besides the weights, and
at a long context the larger part of the program's memory that is not weights."""

CACHE_BYTES_PER_ELEMENT = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0}
"""Bytes per cached key or value element; ``int8`` adds a float scale and an int8 zero point
for every ``head_dim`` elements (:func:`cache_bytes`)."""

_CLASSES = {form.module_class.partition(":")[2]: form for form in FORMS}

__all__ = [
    "CACHE_BYTES_PER_ELEMENT", "CACHE_DTYPES", "CUSTOM_OPS", "DEFAULT_CACHE_DTYPE", "FORMS", "KV_CACHE_ATTRIBUTES",
    "KVCacheForm", "STATIC", "cache_bytes", "kv_cache_forms", *_CLASSES,
]


def kv_cache_forms() -> tuple[KVCacheForm, ...]:
    """Every form the core's KV-cache transforms produce."""
    return FORMS


def cache_bytes(rows: int, n_kv_heads: int, head_dim: int, cache_dtype: str) -> int:
    """Bytes of one layer's keys and values: ``rows`` positions of ``n_kv_heads`` heads."""
    per_head = CACHE_BYTES_PER_ELEMENT[cache_dtype] * head_dim + (5 if cache_dtype == "int8" else 0)
    return int(2 * rows * n_kv_heads * per_head)


def __getattr__(name: str) -> Any:
    """``CustomOpKVAttention`` and ``StaticKVAttention``: each form's class, imported on first use."""
    form = _CLASSES.get(name)
    if form is None:
        raise AttributeError(f"module 'llmcore.kv_cache' has no attribute {name!r}")
    return form.module_type()
