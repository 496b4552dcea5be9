"""A Llama 2/3-style decoder in Meta's parameter layout.

Calling convention (docs/pte-contract.md): ``forward(tokens[1, T], input_pos=None)``
returns the logits of the last position, ``[1, V]``. Attention computes q, k, v and
applies RoPE itself, then hands ``[B, T, H, D]`` tensors to an
:class:`llmcore.modules.CausalAttention` submodule (``layers.N.attention.attn``), the
seam KV-cache transforms replace. There is no cache in here.

RoPE uses Meta's interleaved layout: channel pairs ``(2i, 2i+1)`` of each head are
rotated by ``pos * inv_freq[i]``. It is computed with real cos/sin tables (buffers
``freqs_cos``/``freqs_sin`` of shape ``[max_seq_len, head_dim]``, each value repeated
for both channels of its pair) so the module exports without complex numbers.

RoPE is written with ops that CPU and GPU delegates take (a matmul with a constant
pair-swap matrix, muls, adds, views with one -1) rather than selecting even and odd
channels, which XNNPACK and Vulkan cannot lower. With XNNPACK's ``xnnpack-norms``
transform for the norms, a whole layer lowers to one delegate.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmcore.modules import CausalAttention, RMSNorm, gelu_tanh, positions_slice, static_shape
from llmcore.records import ScalableChannels

__all__ = ["RMSNorm", "Transformer", "build_model", "init_random", "rope_tables"]

from .config import LlamaConfig, RopeScaling


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """``inv_freq[i] = theta ** (-2i / rotary_dim)`` in float32 (as Meta and HF compute it;
    the rotated width is the head's unless rotary is partial), then Llama-3.1 scaling or
    explicit per-frequency factors (GGUF's, LongRoPE's), then linear scaling."""
    dim = config.resolved_rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    elif config.rope_scaling is not None:
        inv_freq = scale_inv_freq(inv_freq, config.rope_scaling)
    if config.rope_linear_factor != 1.0:
        inv_freq = inv_freq / config.rope_linear_factor
    return inv_freq


def scale_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency scaling: keep high frequencies, divide low ones by `factor`,
    interpolate smoothly in between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    mid = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, mid)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, out)


def rope_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``pos * inv_freq``, each ``[max_seq_len, head_dim]`` float32, every
    value repeated for both channels of its rotary pair (so no op is needed to widen them),
    times the attention factor (LongRoPE).

    Channels past a partial rotary width get cos 1 and sin 0: the same rotation code then
    passes them through unchanged, so partial rotary needs no other op in the graph.
    """
    t = torch.arange(config.max_seq_len, dtype=torch.float32)
    angles = torch.outer(t, rope_inv_freq(config)).repeat_interleave(2, dim=-1)
    cos, sin = torch.cos(angles), torch.sin(angles)
    if config.rope_attention_factor != 1.0:
        cos, sin = cos * config.rope_attention_factor, sin * config.rope_attention_factor
    rest = config.resolved_head_dim - config.resolved_rotary_dim
    if rest:
        cos = torch.cat([cos, torch.ones(cos.shape[0], rest)], dim=-1)
        sin = torch.cat([sin, torch.zeros(sin.shape[0], rest)], dim=-1)
    return cos, sin


def local_rope_config(config: LlamaConfig) -> Optional[LlamaConfig]:
    """The config whose RoPE tables the sliding layers use when their base differs (Gemma
    3's ``rope_local_base_freq``): that theta, unscaled; None when every layer shares one."""
    if config.rope_local_theta is None:
        return None
    return replace(
        config, rope_theta=config.rope_local_theta, rope_scaling=None, rope_freq_factors=None,
        rope_linear_factor=1.0, rope_attention_factor=1.0, rope_local_theta=None,
    )


def pair_swap_matrix(head_dim: int) -> torch.Tensor:
    """``P`` with ``(x @ P)[2i] = -x[2i+1]`` and ``(x @ P)[2i+1] = x[2i]``: the partner of
    each channel in its rotary pair, signed. A matmul with it is exact in float32 and,
    unlike selecting the even and odd channels, lowers into the same XNNPACK delegate as
    the projections around it."""
    p = torch.zeros(head_dim, head_dim)
    idx = torch.arange(0, head_dim, 2)
    p[idx + 1, idx] = -1.0
    p[idx, idx + 1] = 1.0
    return p


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pair_swap: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs of ``x [B, T, H, D]``; ``cos/sin`` are ``[1, T, 1, D]``
    rows of :func:`rope_tables`: ``out = x * cos + swap(x) * sin``."""
    xf = x.float()
    shape = static_shape(xf)
    swapped = torch.mm(xf.reshape(-1, xf.shape[-1]), pair_swap).view(shape)
    return (xf * cos + swapped * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int = 0):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.resolved_head_dim
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=config.qkv_bias)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=config.o_bias)
        # Qwen3's per-head norms of q and k, before RoPE (their weights in Meta's channel order)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.attn = CausalAttention(
            self.n_heads, self.n_kv_heads, self.head_dim, config.window_of(layer),
            scale=config.attention_scale, softcap=config.attn_softcap,
        )
        # One swap matrix each for q and k: XNNPACK's partitioner groups the nodes that read
        # one constant, and a q and k sharing it can be grouped across the attention
        # between them (a partition with a dependency cycle, when there is no KV cache).
        self.register_buffer("pair_swap_q", pair_swap_matrix(self.head_dim), persistent=False)
        self.register_buffer("pair_swap_k", pair_swap_matrix(self.head_dim), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        input_pos: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        bsz = x.shape[0]  # static; the sequence dim is left to -1 so the views stay delegated
        q = self.wq(x).view(bsz, -1, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, -1, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, -1, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin, self.pair_swap_q)
        k = apply_rope(k, cos, sin, self.pair_swap_k)
        return self.wo(self.attn(q, k, v, input_pos))


class FeedForward(nn.Module):
    """A gated MLP: ``w2(act(w1 x) * w3 x)``; SwiGLU with ``silu``, GeGLU with ``gelu_tanh``."""

    def __init__(self, dim: int, hidden_dim: int, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.activation = F.silu if activation == "silu" else gelu_tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.activation(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, layer)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.hidden_dim, config.ffn_activation)
        # Gemma's norms on each sublayer's output, before the residual add
        self.attention_post_norm = RMSNorm(config.dim, config.norm_eps) if config.sandwich_norms else None
        self.ffn_post_norm = RMSNorm(config.dim, config.norm_eps) if config.sandwich_norms else None

    def forward(self, x, cos, sin, input_pos=None):
        a = self.attention(self.attention_norm(x), cos, sin, input_pos)
        h = x + (a if self.attention_post_norm is None else self.attention_post_norm(a))
        f = self.feed_forward(self.ffn_norm(h))
        return h + (f if self.ffn_post_norm is None else self.ffn_post_norm(f))


class Transformer(nn.Module):
    """The Llama decoder. ``forward(tokens[1, T], input_pos=None) -> logits[1, V]``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(config)
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)
        local = local_rope_config(config)
        # which layers read the local tables (Gemma 3's sliding layers), when there are two
        self.local_rope_layers = frozenset() if local is None else frozenset(
            config.sliding_layers if config.sliding_layers is not None
            else range(config.n_layers) if config.sliding_window is not None else ()
        )
        if self.local_rope_layers:
            cos, sin = rope_tables(local)
            self.register_buffer("freqs_cos_local", cos, persistent=False)
            self.register_buffer("freqs_sin_local", sin, persistent=False)

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def forward(self, tokens: torch.Tensor, input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        rope = self.rope_at(tokens.shape[1], input_pos)
        local = self.rope_at(tokens.shape[1], input_pos, local=True) if self.local_rope_layers else rope
        h = self.tok_embeddings(tokens)
        if self.config.embedding_multiplier != 1.0:
            h = h * self.config.embedding_multiplier
        for i, layer in enumerate(self.layers):
            h = layer(h, *(local if i in self.local_rope_layers else rope), input_pos)
        logits = self.output(self.norm(h[:, -1, :]))
        if self.config.final_softcap is not None:
            logits = torch.tanh(logits / self.config.final_softcap) * self.config.final_softcap
        return logits

    def reset_buffers(self) -> None:
        """(Re)compute the non-persistent float32 buffers: RoPE tables and pair swaps.
        Needed after construction on the meta device or a cast to another dtype."""
        self.freqs_cos, self.freqs_sin = rope_tables(self.config)
        if self.local_rope_layers:
            self.freqs_cos_local, self.freqs_sin_local = rope_tables(local_rope_config(self.config))
        for layer in self.layers:
            layer.attention.pair_swap_q = pair_swap_matrix(layer.attention.head_dim)
            layer.attention.pair_swap_k = pair_swap_matrix(layer.attention.head_dim)

    def rope_at(self, seq_len: int, input_pos: Optional[torch.Tensor] = None, local: bool = False):
        """cos and sin for positions ``[start, start + seq_len)``, shaped ``[1, T, 1, D]``,
        from the local (sliding layers') tables when asked. Computed once per forward,
        outside the layers."""
        cos = positions_slice(self.freqs_cos_local if local else self.freqs_cos, seq_len, input_pos)
        sin = positions_slice(self.freqs_sin_local if local else self.freqs_sin, seq_len, input_pos)
        return cos.view(1, -1, 1, cos.shape[-1]), sin.view(1, -1, 1, sin.shape[-1])

    def scalable_channels(self) -> list[ScalableChannels]:
        """Where a quantizer may fold per-channel input scales (:mod:`llmcore.channel_scales`),
        per layer: each pre-norm into the projections it feeds; the values into the output
        projection (attention mixes positions, never channels, and head ``h`` reads kv head
        ``h // repeats``); the up projection into the down projection (``act(w1 x) * w3 x``
        is linear in ``w3 x`` per channel). The post-norms of sandwich-norm layers and
        Qwen3's q/k norms sit after these projections and are untouched by them. Layers
        whose attention or MLP a transform replaced are left out."""
        found = []
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}"
            attention, mlp = layer.attention, layer.feed_forward
            if type(attention) is Attention:
                found.append(ScalableChannels(f"{p}.attention_norm", tuple(
                    f"{p}.attention.{w}" for w in ("wq", "wk", "wv"))))
                found.append(ScalableChannels(f"{p}.attention.wv", (f"{p}.attention.wo",),
                                              attention.n_heads // attention.n_kv_heads, attention.head_dim))
            if type(mlp) is FeedForward:
                found.append(ScalableChannels(f"{p}.ffn_norm", (f"{p}.feed_forward.w1", f"{p}.feed_forward.w3")))
                found.append(ScalableChannels(f"{p}.feed_forward.w3", (f"{p}.feed_forward.w2",)))
        return found

    def tie_weights(self) -> None:
        """Re-tie ``output`` to ``tok_embeddings`` (after ``load_state_dict``, ``to()``)."""
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight


def init_random(model: Transformer, seed: int = 0) -> Transformer:
    """Deterministic small-normal init (std 0.02, ones for norms)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)

            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def build_model(config: LlamaConfig, state_dict: Optional[dict] = None, *, strict: bool = True) -> Transformer:
    """A model with `state_dict` (Meta names, float tensors) loaded, or uninitialised.

    Construction happens on the meta device, so no memory is spent on weights that are
    immediately replaced.
    """
    if state_dict is None:
        return Transformer(config)
    with torch.device("meta"):
        model = Transformer(config)
    sd = dict(state_dict)
    if config.tie_embeddings:
        sd.pop("output.weight", None)
    expected = model.state_dict()
    wrong = [k for k, v in sd.items() if k in expected and tuple(v.shape) != tuple(expected[k].shape)]
    if wrong:
        k = wrong[0]
        raise ValueError(
            f"wrong shape for {len(wrong)} tensor(s), e.g. {k}: {list(sd[k].shape)}, "
            f"expected {list(expected[k].shape)}"
        )
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if config.tie_embeddings:
        missing = [m for m in missing if m != "output.weight"]
    if strict and (missing or unexpected):
        raise KeyError(f"state dict does not fit the Llama config: missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
    model.tie_weights()
    model.reset_buffers()
    return model
