"""Attention for Vulkan programs without a KV cache.

:class:`llmcore.modules.CausalAttention` calls ``scaled_dot_product_attention(...,
is_causal=True)``. ExecuTorch decomposes that into a mask filled with ``-inf``; the Vulkan
serialiser writes the fill value into its JSON graph as ``-Infinity``, which ``flatc``
refuses (``cannot parse value starting with: -``), so the export fails.

:class:`FiniteMaskAttention` computes the same attention from plain operators that the
Vulkan delegate implements with dynamic shapes (``bmm``, ``add``, ``softmax``) and a
precomputed additive mask of *finite* values: 0 where a query may look, ``MASK_VALUE``
above the diagonal. ``exp(MASK_VALUE - max)`` is exactly 0 in fp32 and fp16, so the
result equals the ``-inf`` mask's (see the equivalence tests), and the value is
representable in fp16 (``force_fp16``).

The mask is a buffer of ``max_seq_len`` rows and ``max_seq_len + 1`` columns, sliced to
``[:T, :T]``. The extra column keeps the column slice from ever being the whole row:
otherwise ``torch.export`` specialises on ``T == max_seq_len`` (the slice would be
contiguous exactly then) and refuses the dynamic sequence length.

Programs with the default KV cache (``kv-cache``: ``llama::update_cache`` and
``llama::custom_sdpa``) need nothing from here: the Vulkan delegate implements those ops
(it fuses them into its own SDPA with cache).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from llmcore.errors import LlmcoreError
from llmcore.modules import CausalAttention, repeat_kv, replace_modules, refuse_unusual_attention

# Finite "minus infinity": fits fp16 (max 65504) even after adding a score to it.
MASK_VALUE = -30000.0


def causal_mask(rows: int, cols: int, value: float = MASK_VALUE) -> torch.Tensor:
    """``[rows, cols]``: 0 on and below the diagonal, ``value`` above it."""
    return torch.full((rows, cols), value, dtype=torch.float32).triu(1)


class FiniteMaskAttention(nn.Module):
    """Causal attention over ``[B, T, H, D]`` q/k/v with a finite additive mask.

    Same interface and result as :class:`~llmcore.modules.CausalAttention` (no cache).
    """

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, max_seq_len: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.max_seq_len = max_seq_len
        self.scale = head_dim**-0.5
        self.register_buffer("mask", causal_mask(max_seq_len, max_seq_len + 1), persistent=False)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        input_pos: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if input_pos is not None:
            raise ValueError("FiniteMaskAttention has no KV cache; it takes no input_pos")
        bsz, seq_len, n_heads, head_dim = q.shape
        n_rep = self.n_heads // self.n_kv_heads
        # [B, H, T, D] -> [B*H, T, D]: three-dimensional bmm, no broadcasting (whose
        # expand the Vulkan delegate does not take with dynamic shapes).
        q = q.transpose(1, 2).reshape(bsz * n_heads, seq_len, head_dim)
        k = repeat_kv(k.transpose(1, 2), n_rep).reshape(bsz * n_heads, seq_len, head_dim)
        v = repeat_kv(v.transpose(1, 2), n_rep).reshape(bsz * n_heads, seq_len, head_dim)
        scores = torch.bmm(q, k.transpose(1, 2)) * self.scale + self.mask[:seq_len, :seq_len]
        y = torch.bmm(torch.softmax(scores, dim=-1), v)
        return y.view(bsz, n_heads, seq_len, head_dim).transpose(1, 2).reshape(bsz, seq_len, n_heads * head_dim)


def _has_plain_pytorch_cache(module: nn.Module) -> bool:
    from llmcore.kv_cache import StaticKVAttention

    return any(isinstance(m, StaticKVAttention) for m in module.modules())


def apply(module: nn.Module, context) -> nn.Module:
    """The ``vulkan-attention`` transform: every remaining ``CausalAttention`` (a program
    without a KV cache) becomes a :class:`FiniteMaskAttention`."""
    if _has_plain_pytorch_cache(module):
        raise LlmcoreError(
            "the plain-PyTorch KV cache (kv-cache-static) masks with -inf, which the Vulkan "
            "serialiser cannot write.",
            stage="transform",
            plugin="vulkan",
            fix="drop --transforms kv-cache-static: Vulkan runs the default kv-cache (its custom ops are "
            "Vulkan operators), or pass --skip-transforms kv-cache for a program without a cache.",
        )
    refuse_unusual_attention(
        module, plugin="vulkan", form="the Vulkan attention forms",
        fix="export this model for xnnpack (its attention and KV cache implement these), or, for a window, "
        "pass --max-seq-len no longer than the window if the model family allows it.",
    )
    replace_modules(
        module,
        CausalAttention,
        lambda a: FiniteMaskAttention(a.n_heads, a.n_kv_heads, a.head_dim, context.max_seq_len),
    )
    return module
