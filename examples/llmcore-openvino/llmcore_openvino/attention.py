"""Attention for OpenVINO programs without a KV cache.

``scaled_dot_product_attention(..., is_causal=True)`` decomposes into a boolean mask built
with ``logical_and``, which ExecuTorch's OpenVINO partitioner does not take: the mask is
left to the portable runtime and splits the graph into two delegates, one of which then
receives the dynamic sequence length as a ``SymInt`` input that OpenVINO cannot compile.
:class:`AdditiveMaskAttention` computes the same attention from ``matmul``, ``add`` and
``softmax`` with a precomputed additive mask (0 / ``MASK_VALUE``, finite), all OpenVINO
operators, so one delegate holds the whole transformer.

The transform also replaces ``kv-cache``: a cached program reads its position with
``input_pos[0].item()``, and that scalar (a ``SymInt``) reaches the OpenVINO delegates as
an input, which ExecuTorch's OpenVINO preprocessing cannot compile (the default cache's
``llama::`` ops and ``kv-cache-static`` fail alike). OpenVINO programs therefore follow
the no-cache calling convention of ``docs/pte-contract.md``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from llmcore.modules import CausalAttention, repeat_kv, replace_modules

MASK_VALUE = -30000.0  # exp(MASK_VALUE - max) == 0 in fp32 and fp16


class AdditiveMaskAttention(nn.Module):
    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, max_seq_len: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5
        # one spare column: the [:T, :T] slice never spans a whole row, so torch.export
        # does not specialise on T == max_seq_len
        mask = torch.full((max_seq_len, max_seq_len + 1), MASK_VALUE).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, q, k, v, input_pos: Optional[torch.Tensor] = None):
        if input_pos is not None:
            raise ValueError("AdditiveMaskAttention has no KV cache; it takes no input_pos")
        bsz, seq_len = q.shape[0], q.shape[1]
        n_rep = self.n_heads // self.n_kv_heads
        q = q.transpose(1, 2)  # [B, H, T, D]
        k = repeat_kv(k.transpose(1, 2), n_rep)
        v = repeat_kv(v.transpose(1, 2), n_rep)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale + self.mask[:seq_len, :seq_len]
        y = torch.matmul(torch.softmax(scores, dim=-1), v)
        return y.transpose(1, 2).reshape(bsz, seq_len, self.n_heads * self.head_dim)


def apply(module: nn.Module, context) -> nn.Module:
    """The ``openvino-attention`` transform: each ``CausalAttention`` becomes an
    :class:`AdditiveMaskAttention`; the program has no KV cache."""
    if context.use_kv_cache:
        from llmcore.errors import LlmcoreError

        raise LlmcoreError(
            "OpenVINO programs cannot have a KV cache yet: the cache position (input_pos.item()) reaches "
            "the OpenVINO delegate as a SymInt input, which OpenVINO's compile step cannot type.",
            stage="transform",
            plugin="openvino",
            fix="drop --transforms kv-cache-static (openvino programs recompute the window each step).",
        )
    replace_modules(
        module,
        lambda m: type(m) is CausalAttention,
        lambda a: AdditiveMaskAttention(a.n_heads, a.n_kv_heads, a.head_dim, context.max_seq_len),
    )
    return module
