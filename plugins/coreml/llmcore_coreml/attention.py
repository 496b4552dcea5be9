"""Attention for Core ML programs: one fused SDPA op per layer, and a cache Core ML keeps.

Core ML has its own scaled-dot-product-attention operation (iOS 18 / macOS 15). The
coremltools PyTorch frontend converts an op named ``coreml::sdpa`` (``q, k, v,
attn_mask``) into it; ExecuTorch's Core ML LLM flow routes attention through that op so
that ``to_edge`` does not decompose it into matmul + softmax. :func:`ensure_sdpa_op`
defines the op here when no other module did (same signature: SDPA with an additive
mask, no causal flag, default scale).

* :class:`CoreMLAttention` replaces :class:`llmcore.modules.CausalAttention` in programs
  without a KV cache: ``coreml::sdpa`` with a finite causal mask sliced to ``[T, T]``.
* :class:`CoreMLKVAttention` replaces the default cache (``kv-cache``), whose
  ``llama::`` custom ops Core ML cannot convert (the partition then receives the
  position as a bare ``SymInt`` and the conversion fails). Its cache buffers are
  ``[1, H_kv, S, D]``, written with ``index_put_`` (Core ML ``slice_update``; with
  ``take_over_mutable_buffer`` the cache lives in the delegate as Core ML state). Each
  call attends over the whole cache with the mask rows of its positions, so key and value
  shapes are static (``S``) whatever ``T`` and ``input_pos`` are, and the position is
  never turned into a Python integer: no data-dependent shapes reach Core ML.

The masks hold ``MASK_VALUE`` (finite, fp16-safe) where a query may not look; unwritten
cache rows are always in a query's future, so they are masked too.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmcore.modules import CausalAttention, repeat_kv, replace_modules, refuse_unusual_attention
from llmcore.records import Transformed

MASK_VALUE = -30000.0
SDPA_OP = "coreml::sdpa"


def ensure_sdpa_op() -> None:
    """Make ``torch.ops.coreml.sdpa`` exist (eager: SDPA with an additive float mask)."""
    try:
        torch.ops.coreml.sdpa.default
        return
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op(SDPA_OP, mutates_args=())
    def _coreml_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

    @_coreml_sdpa.register_fake
    def _(q, k, v, attn_mask):
        return q.new_empty((*q.shape[:-1], v.shape[-1]))


def causal_mask(rows: int, cols: int, value: float = MASK_VALUE) -> torch.Tensor:
    """``[rows, cols]``: 0 where column <= row, ``value`` elsewhere."""
    return torch.full((rows, cols), value, dtype=torch.float32).triu(1)


class CoreMLAttention(nn.Module):
    """Causal attention without a cache through ``coreml::sdpa``.

    The mask buffer has one column more than rows so that slicing it to ``[:T, :T]``
    never takes a whole row: ``torch.export`` would otherwise specialise on
    ``T == max_seq_len``.
    """

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, max_seq_len: int):
        super().__init__()
        ensure_sdpa_op()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.register_buffer("mask", causal_mask(max_seq_len, max_seq_len + 1), persistent=False)

    def forward(self, q, k, v, input_pos: Optional[torch.Tensor] = None):
        if input_pos is not None:
            raise ValueError("CoreMLAttention has no KV cache; it takes no input_pos")
        bsz, seq_len = q.shape[0], q.shape[1]
        n_rep = self.n_heads // self.n_kv_heads
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        y = torch.ops.coreml.sdpa(q, k, v, self.mask[:seq_len, :seq_len])
        return y.transpose(1, 2).reshape(bsz, seq_len, self.n_heads * self.head_dim)


class CoreMLKVAttention(nn.Module):
    """Static KV cache for Core ML: ``index_put_`` writes, ``coreml::sdpa`` over the whole
    cache with the mask rows of the written positions."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, capacity: int):
        super().__init__()
        ensure_sdpa_op()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.capacity = capacity
        # [S, H_kv, D]: the written dimension first, so that the write is an index_put_
        # with one full index tensor (Core ML scatter_nd; coremltools' slice-update path
        # for partial indices takes a single position only).
        shape = (capacity, n_kv_heads, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("mask", causal_mask(capacity, capacity), persistent=False)
        self.register_buffer("offsets", torch.arange(capacity), persistent=False)

    def forward(self, q, k, v, input_pos: Optional[torch.Tensor] = None):
        if input_pos is None:
            raise ValueError("CoreMLKVAttention needs input_pos (the position of the first token)")
        bsz, seq_len = q.shape[0], q.shape[1]
        positions = self.offsets[:seq_len] + input_pos  # [T], a tensor: never a Python int
        torch.ops.aten.index_put_(self.k_cache, [positions], k[0])  # rows `positions` <- [T, H_kv, D]
        torch.ops.aten.index_put_(self.v_cache, [positions], v[0])
        n_rep = self.n_heads // self.n_kv_heads
        keys = repeat_kv(self.k_cache.transpose(0, 1).unsqueeze(0), n_rep)  # [1, H, S, D]
        values = repeat_kv(self.v_cache.transpose(0, 1).unsqueeze(0), n_rep)
        mask = self.mask.index_select(0, positions)  # [T, S]: a query sees cache rows <= its position
        y = torch.ops.coreml.sdpa(q.transpose(1, 2), keys, values, mask)
        return y.transpose(1, 2).reshape(bsz, seq_len, self.n_heads * self.head_dim)


def apply(module: nn.Module, context) -> nn.Module:
    """The ``coreml-attention`` transform.

    * the default cache (``kv-cache``'s ``llama::`` custom ops) becomes a
      :class:`CoreMLKVAttention` of the same capacity;
    * attention without a cache (``--skip-transforms kv-cache``) becomes a
      :class:`CoreMLAttention`;
    * the plain-PyTorch cache (``--transforms kv-cache-static``) is left as it is: Core ML
      converts its ``index_put_`` and masked SDPA as they are.
    """
    from llmcore.kv_cache import CustomOpKVAttention, StaticKVAttention

    refuse_unusual_attention(
        module, plugin="coreml", form="the Core ML attention forms", allowed=(StaticKVAttention,),
        fix="pass --transforms kv-cache-static: Core ML converts its plain-PyTorch attention as it is, windows, "
        "scales and soft-capping included.",
    )
    cached = replace_modules(
        module,
        CustomOpKVAttention,
        lambda a: CoreMLKVAttention(a.n_heads, a.n_kv_heads, a.head_dim, a.capacity),
    )
    replace_modules(
        module,
        CausalAttention,
        lambda a: CoreMLAttention(a.n_heads, a.n_kv_heads, a.head_dim, context.max_seq_len),
    )
    if cached:
        # The program no longer calls llama::custom_sdpa (docs/pte-contract.md).
        return Transformed(module, dataclasses.replace(context.convention, use_sdpa_with_kv_cache=False))
    return module
