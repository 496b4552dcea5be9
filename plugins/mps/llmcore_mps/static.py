"""The ``mps-static-length`` transform: a program whose delegate sees fixed shapes.

MPS (``MPSGraph``) needs static shapes, while llmcore programs take ``T`` tokens with
``1 <= T <= max_seq_len`` (``docs/pte-contract.md``). The transform keeps that calling
convention and makes everything behind the first operator static:

1. the tokens are padded (on the CPU) to ``L = max_seq_len`` positions;
2. the model's blocks run on all ``L`` positions, with :class:`StaticMaskAttention`: a
   causal mask of finite values (``MASK_VALUE``, no ``-inf``, no boolean fill: MPS's
   serialiser cannot write either), so the padding after position ``T - 1`` never
   reaches positions ``< T``;
3. the hidden state of position ``T - 1`` is selected (on the CPU) and goes through the
   final norm and the output layer.

The logits equal the original model's (see the equivalence tests). Each call costs a
full ``L``-position forward, so keep ``--max-seq-len`` to what the application needs.
There is no KV cache: a cache's prefill writes ``T`` rows at a data-dependent position,
which has no static form; the transform therefore replaces ``kv-cache``.

The model's top-level forward is re-expressed per family (it is where the last position
is taken), from the family's own submodules: nanoGPT and Llama are supported.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmcore.errors import LlmcoreError
from llmcore.modules import CausalAttention, repeat_kv, replace_modules, refuse_unusual_attention

MASK_VALUE = -30000.0


class StaticMaskAttention(nn.Module):
    """Causal attention over exactly ``length`` positions with a finite additive mask."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, length: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.length = length
        self.scale = head_dim**-0.5
        mask = torch.full((length, length), MASK_VALUE, dtype=torch.float32).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, q, k, v, input_pos: Optional[torch.Tensor] = None):
        if input_pos is not None:
            raise ValueError("StaticMaskAttention has no KV cache; it takes no input_pos")
        bsz, seq_len = q.shape[0], q.shape[1]
        n_rep = self.n_heads // self.n_kv_heads
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale + self.mask
        y = torch.matmul(torch.softmax(scores, dim=-1), v)
        return y.transpose(1, 2).reshape(bsz, seq_len, self.n_heads * self.head_dim)


class StaticLength(nn.Module):
    """``forward(tokens[1, T]) -> logits[1, V]`` computed on ``length`` padded positions."""

    def __init__(self, model: nn.Module, length: int, body: Callable, head: Callable):
        super().__init__()
        self.model = model
        self.length = length
        self._body, self._head = body, head

    def forward(self, tokens: torch.Tensor, input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        if input_pos is not None:
            raise ValueError("a static-length program has no KV cache; it takes no input_pos")
        seq_len = tokens.shape[1]
        padded = F.pad(tokens, (0, self.length - seq_len))  # [1, L]: static from here on
        hidden = self._body(self.model, padded)  # [1, L, C]
        last = hidden.narrow(1, seq_len - 1, 1).squeeze(1)  # [1, C]
        return self._head(self.model, last)


def _gpt_body(m, tokens):
    length = tokens.shape[1]
    x = m.transformer.wte(tokens) + m.transformer.wpe.weight[:length]
    for block in m.transformer.h:
        x = block(x, None)
    return x


def _gpt_head(m, last):
    return m.lm_head(m.transformer.ln_f(last))


def _llama_body(m, tokens):
    length = tokens.shape[1]
    cos, sin = m.rope_at(length, None)
    h = m.tok_embeddings(tokens)
    for layer in m.layers:
        h = layer(h, cos, sin, None)
    return h


def _llama_head(m, last):
    return m.output(m.norm(last))


# family -> (attributes its model must have, body, head)
FAMILIES = {
    "nanogpt": (("transformer", "lm_head"), _gpt_body, _gpt_head),
    "llama": (("tok_embeddings", "layers", "norm", "output", "freqs_cos", "freqs_sin"), _llama_body, _llama_head),
}


def static_length(module: nn.Module, family: str, length: int) -> StaticLength:
    """Wrap ``module`` (an eager model of ``family``) into a :class:`StaticLength` of
    ``length`` positions, its attention replaced by :class:`StaticMaskAttention`."""
    if family not in FAMILIES:
        raise LlmcoreError(
            f"the MPS backend needs a static-length form of the model, and there is none for family {family!r}.",
            stage="transform",
            plugin="mps",
            fix=f"MPS supports the families {', '.join(FAMILIES)}; export this one for coreml (Apple GPU and Neural "
            "Engine, dynamic shapes) instead.",
        )
    attributes, body, head = FAMILIES[family]
    missing = [a for a in attributes if not hasattr(module, a)]
    if missing:
        raise LlmcoreError(
            f"the {family} model has no {', '.join(missing)}; the MPS static-length form does not know this layout.",
            stage="transform",
            plugin="mps",
        )
    refuse_unusual_attention(
        module, plugin="mps", form="the MPS static-length form",
        fix="export this model for coreml or xnnpack, or pass --max-seq-len no longer than the window if the "
        "model family allows it.",
    )

    def static_mask(a: CausalAttention) -> nn.Module:
        return StaticMaskAttention(a.n_heads, a.n_kv_heads, a.head_dim, length)

    if replace_modules(module, CausalAttention, static_mask) == 0:
        raise LlmcoreError(
            "MPS programs have no KV cache, and the model's attention was already replaced (by a KV-cache "
            "transform?).",
            stage="transform",
            plugin="mps",
            fix="drop --transforms kv-cache-static: MPS needs static shapes, which a cache's prefill cannot have.",
        )
    return StaticLength(module, length, body, head)


def apply(module: nn.Module, context) -> nn.Module:
    return static_length(module, context.family, context.max_seq_len)
