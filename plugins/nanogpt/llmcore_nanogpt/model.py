"""The GPT-2 architecture with nanoGPT's parameter names.

Parameter names follow nanoGPT (``transformer.wte``, ``transformer.h.N.attn.c_attn``, ...)
so that nanoGPT's ``ckpt.pt`` state dicts load as they are. Attention goes through
:class:`llmcore.modules.CausalAttention`, the seam that KV-cache and backend transforms
replace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from llmcore.modules import CausalAttention, LayerNorm, gelu_tanh, positions_slice


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = True
    dropout: float = 0.0  # accepted for nanoGPT compatibility; inference ignores it


# Named configurations; their descriptions live in the plugin's ModelFamily record.
CONFIGS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "tiny": GPTConfig(block_size=128, vocab_size=257, n_layer=2, n_head=4, n_embd=64),
}


class SelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn = CausalAttention(config.n_head, config.n_head, self.head_dim)

    def forward(self, x: torch.Tensor, input_pos: Optional[torch.Tensor]) -> torch.Tensor:
        qkv = self.c_attn(x)
        q, k, v = qkv if isinstance(qkv, tuple) else qkv.split(x.shape[-1], dim=2)
        shape = (x.shape[0], -1, self.n_head, self.head_dim)  # -1: the sequence, kept delegable
        y = self.attn(q.view(shape), k.view(shape), v.view(shape), input_pos)
        return self.c_proj(y)


class SplitQKV(nn.Module):
    """``c_attn`` as three projections returning ``(q, k, v)``.

    Splitting the fused projection's output is a ``split_with_sizes`` that XNNPACK cannot
    take (nor can it slice a tensor of dynamic length), so every block would leave its
    delegate there. Three linears with the rows of the fused one compute the same values
    and stay in one delegate; per-row (per-channel, per-group) quantization sees the same
    rows either way.
    """

    def __init__(self, fused: nn.Linear):
        from llmcore import stored

        super().__init__()
        width = fused.out_features // 3
        self.q, self.k, self.v = (
            nn.Linear(fused.in_features, width, bias=fused.bias is not None, device="meta") for _ in range(3)
        )
        # what the loader recorded of the fused weight (a GGUF's integers, or the weight left
        # in its file), for each part's rows: the recipe then keeps the file's integers
        form = stored.record(fused.weight)
        for i, proj in enumerate((self.q, self.k, self.v)):
            rows = slice(i * width, (i + 1) * width)
            if stored.in_file(fused.weight):  # still in the file: the parts are read from it too
                weight = torch.empty(width, fused.in_features, device="meta")
            else:
                weight = fused.weight.detach()[rows].clone()
            proj.weight = nn.Parameter(weight, requires_grad=False)
            if form is not None:
                stored.remember(proj.weight, stored.stored_rows(form, rows.start, rows.stop))
            if fused.bias is not None:
                proj.bias = nn.Parameter(fused.bias.detach()[rows].clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q(x), self.k(x), self.v(x)


def split_qkv(model: nn.Module) -> int:
    """Replace every :class:`SelfAttention`'s fused ``c_attn`` with :class:`SplitQKV`."""
    count = 0
    for module in model.modules():
        if isinstance(module, SelfAttention) and isinstance(module.c_attn, nn.Linear):
            module.c_attn = SplitQKV(module.c_attn)
            count += 1
    return count


class MLP(nn.Module):
    """``c_proj(gelu(c_fc(x)))``, GPT-2's GELU with the tanh approximation (``gelu_new``).

    ``activation`` names the function, so that a backend that fuses the MLP (llmcore-kernels)
    computes that one and can refuse another rather than guess it from the numbers."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.activation = gelu_tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.activation(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = SelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, input_pos: Optional[torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), input_pos)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2: ``forward(tokens[1, T], input_pos=None) -> logits[1, vocab]`` (last position)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2

    def init_random(self, seed: int = 0) -> "GPT":
        """GPT-2's initialisation (normal 0.02, scaled residual projections), seeded."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            else:
                std = 0.02
                if name.endswith("c_proj.weight"):
                    std = 0.02 / math.sqrt(2 * self.config.n_layer)
                with torch.no_grad():
                    p.normal_(0.0, std, generator=gen)
        return self

    def forward(self, tokens: torch.Tensor, input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        seq_len = tokens.shape[1]
        pos_emb = positions_slice(self.transformer.wpe.weight, seq_len, input_pos)
        x = self.transformer.wte(tokens) + pos_emb
        for block in self.transformer.h:
            x = block(x, input_pos)
        x = self.transformer.ln_f(x[:, -1, :])
        return self.lm_head(x)
