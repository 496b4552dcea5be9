"""KV-cache source transforms, for every model family that attends through
:class:`llmcore.modules.CausalAttention`.

Both transforms swap each ``CausalAttention`` for a module that keeps keys and values of
past positions in buffers, and switch the program to ``forward(tokens, input_pos)``:

* ``kv-cache`` (on by default): ExecuTorch's LLM custom ops ``llama::update_cache``
  (writes the new rows in place) and ``llama::custom_sdpa`` (attends to positions
  ``[0, input_pos + T)`` only). The process that runs the program must load
  ``executorch.extension.llm.custom_ops.custom_ops``; llmcore's runners do.
* ``kv-cache-static``: plain PyTorch, for backends without those ops. The cache is
  written with ``index_put_`` so that ExecuTorch's re-inplace pass updates the buffer in
  place; an ``index_copy_`` cache would instead copy the whole cache every step.

Sliding-window layers (``CausalAttention.window``) keep the same full-length cache and
add the window to the mask, so generation runs past the window up to the program's
context and matches transformers. The custom-op variant then passes ``custom_sdpa`` an
explicit ``[T, capacity]`` mask (with a mask the op attends over the whole cache, so a
sliding layer's step costs the full capacity, not ``input_pos + T``). The cache is not
smaller than the context: a ring buffer of the window needs prompts fed in chunks no
longer than the window, which the runners do not do yet.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmcore import hookimpl
from llmcore.modules import CausalAttention, attention_mask, repeat_kv, replace_modules
from llmcore.records import SourceTransform, TransformContext

CUSTOM_OPS_MODULE = "executorch.extension.llm.custom_ops.custom_ops"


def _start(input_pos: torch.Tensor, seq_len: int, capacity: int) -> int:
    start = input_pos[0].item()
    torch._check(start >= 0)
    torch._check(start + seq_len <= capacity)
    return start


def _window(window: Optional[int], capacity: int) -> Optional[int]:
    """The window a cache must apply: none when it holds no more than the window anyway."""
    return window if window is not None and window < capacity else None


class CustomOpKVAttention(nn.Module):
    """Cached attention through ``llama::update_cache`` + ``llama::custom_sdpa``."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, capacity: int, window: Optional[int] = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.capacity = capacity
        self.window = _window(window, capacity)
        shape = (1, capacity, n_kv_heads, head_dim)  # [B, S, H, D]: the ops' layout
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, q, k, v, input_pos: Optional[torch.Tensor] = None):
        bsz, seq_len = q.shape[0], q.shape[1]
        start = _start(input_pos, seq_len, self.capacity)
        torch.ops.llama.update_cache(k.float(), self.k_cache, start)
        torch.ops.llama.update_cache(v.float(), self.v_cache, start)
        if self.window is None:
            y = torch.ops.llama.custom_sdpa(q.float(), self.k_cache, self.v_cache, start, None, 0.0, True)
        else:  # an explicit mask over the whole cache (the op then ignores start and is_causal)
            positions = torch.arange(start, start + seq_len)
            allowed = attention_mask(positions, torch.arange(self.capacity), self.window)
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
            y = torch.ops.llama.custom_sdpa(q.float(), self.k_cache, self.v_cache, start, mask, 0.0, False)
        return y.reshape(bsz, seq_len, self.n_heads * self.head_dim).to(q.dtype)


class StaticKVAttention(nn.Module):
    """Cached attention in plain PyTorch: ``index_put_`` writes, masked SDPA over the
    filled part of the cache."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, capacity: int, window: Optional[int] = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.capacity = capacity
        self.window = _window(window, capacity)
        # [S, H, D], batch of one: the written dimension comes first, which is the form
        # of in-place index_put the ExecuTorch runtime accepts.
        shape = (capacity, n_kv_heads, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, q, k, v, input_pos: Optional[torch.Tensor] = None):
        bsz, seq_len = q.shape[0], q.shape[1]
        start = _start(input_pos, seq_len, self.capacity)
        positions = torch.arange(seq_len) + start
        self.k_cache[positions] = k[0]  # aten.index_put_: re-inplaced by ExecuTorch
        self.v_cache[positions] = v[0]
        end = start + seq_len
        keys = self.k_cache.narrow(0, 0, end).transpose(0, 1).unsqueeze(0)  # [1, H, end, D]
        values = self.v_cache.narrow(0, 0, end).transpose(0, 1).unsqueeze(0)
        n_rep = self.n_heads // self.n_kv_heads
        keys, values = repeat_kv(keys, n_rep), repeat_kv(values, n_rep)
        mask = attention_mask(positions, torch.arange(end), self.window)  # [T, end]
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
        return y.transpose(1, 2).reshape(bsz, seq_len, self.n_heads * self.head_dim)


def _apply(module: nn.Module, context: TransformContext, cls, uses_custom_ops: bool) -> nn.Module:
    if uses_custom_ops:
        import importlib

        importlib.import_module(CUSTOM_OPS_MODULE)  # registers torch.ops.llama.*
    capacity = context.max_seq_len

    def make(attn: CausalAttention) -> nn.Module:
        return cls(attn.n_heads, attn.n_kv_heads, attn.head_dim, capacity, attn.window)

    if replace_modules(module, CausalAttention, make) == 0:
        raise ValueError(
            "the model has no llmcore.modules.CausalAttention submodule to give a cache; "
            "its family must route attention through CausalAttention"
        )
    context.use_kv_cache = True
    context.use_sdpa_with_kv_cache = uses_custom_ops
    if uses_custom_ops and CUSTOM_OPS_MODULE not in context.runtime_imports:
        context.runtime_imports.append(CUSTOM_OPS_MODULE)
    return module


@hookimpl
def llmcore_source_transforms() -> list[SourceTransform]:
    return [
        SourceTransform(
            name="kv-cache",
            description="static KV cache through ExecuTorch's llama::update_cache and llama::custom_sdpa (default)",
            apply=lambda m, c: _apply(m, c, CustomOpKVAttention, uses_custom_ops=True),
            order=50,
            automatic=True,
        ),
        SourceTransform(
            name="kv-cache-static",
            description="static KV cache in plain PyTorch (index_put_ + masked SDPA), for backends without the custom ops",
            apply=lambda m, c: _apply(m, c, StaticKVAttention, uses_custom_ops=False),
            order=50,
            replaces=("kv-cache",),
        ),
    ]
