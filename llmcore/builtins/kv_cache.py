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


def window_mask(input_pos: torch.Tensor, seq_len: int, capacity: int, window: int) -> torch.Tensor:
    """The additive ``[T, capacity]`` mask (0 or -inf) of queries at ``input_pos[0] + t``
    over a cache of ``capacity`` positions, for a sliding ``window``."""
    start = input_pos[0].item()
    torch._check(start >= 0)
    allowed = attention_mask(torch.arange(start, start + seq_len), torch.arange(capacity), window)
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))


class WindowMasks:
    """The sliding-window masks of one model, computed once per forward.

    Every sliding layer of one window needs the same ``[T, capacity]`` mask. Computed in
    each layer, the program kept one per layer in its planned memory (the masks of all
    layers outlive the delegates placed between them): 412 MiB instead of 56 for a 30-layer,
    1024-position program. A forward pre-hook on the model (:meth:`before_forward`)
    computes them from ``(tokens, input_pos)`` before the layers run, in the graph's
    prelude, like the RoPE tables; a cache takes its window's mask when it is handed the
    ``input_pos`` the hook saw, and computes its own otherwise (called on its own).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.windows: set[int] = set()
        self._input_pos: Optional[torch.Tensor] = None
        self._masks: dict[int, torch.Tensor] = {}

    def before_forward(self, module, args, kwargs) -> None:
        tokens = args[0] if args else kwargs.get("tokens")
        input_pos = args[1] if len(args) > 1 else kwargs.get("input_pos")
        self.after_forward()
        if isinstance(tokens, torch.Tensor) and isinstance(input_pos, torch.Tensor):
            self._input_pos = input_pos
            self._masks = {w: window_mask(input_pos, tokens.shape[1], self.capacity, w) for w in self.windows}

    def after_forward(self, *_) -> None:
        self._input_pos, self._masks = None, {}  # hold no tensors between calls

    def mask(self, input_pos: torch.Tensor, seq_len: int, window: int) -> torch.Tensor:
        if input_pos is self._input_pos and window in self._masks:
            return self._masks[window]
        return window_mask(input_pos, seq_len, self.capacity, window)


class CustomOpKVAttention(nn.Module):
    """Cached attention through ``llama::update_cache`` + ``llama::custom_sdpa``."""

    def __init__(
        self,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        window: Optional[int] = None,
        masks: Optional[WindowMasks] = None,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.capacity = capacity
        self.window = _window(window, capacity)
        self.masks = masks if masks is not None else WindowMasks(capacity)
        if self.window is not None:
            self.masks.windows.add(self.window)
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
            mask = self.masks.mask(input_pos, seq_len, self.window)
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
    masks = WindowMasks(capacity)

    def make(attn: CausalAttention) -> nn.Module:
        if cls is CustomOpKVAttention:
            return cls(attn.n_heads, attn.n_kv_heads, attn.head_dim, capacity, attn.window, masks)
        return cls(attn.n_heads, attn.n_kv_heads, attn.head_dim, capacity, attn.window)

    if replace_modules(module, CausalAttention, make) == 0:
        raise ValueError(
            "the model has no llmcore.modules.CausalAttention submodule to give a cache; "
            "its family must route attention through CausalAttention"
        )
    if masks.windows:  # sliding layers: their masks once per forward, before the layers
        module.register_forward_pre_hook(masks.before_forward, with_kwargs=True)
        module.register_forward_hook(masks.after_forward)
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
