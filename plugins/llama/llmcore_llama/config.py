"""Llama hyper-parameters and the named random-init configurations.

This module imports nothing heavy, so the plugin's hooks can describe configs without
importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1-style RoPE frequency scaling ("llama3" rope type)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


FFN_ACTIVATIONS = ("silu", "gelu_tanh")

# Bounds on sizes, far beyond any llama-architecture model (Llama 3.1 405B: dim 16384, ffn
# 53248, 126 layers, 128 heads; the longest contexts are around 1M): a checkpoint outside
# them is damaged, and building RoPE tables or weights for it would exhaust memory.
_LIMITS = {
    "dim": 1 << 16,
    "n_layers": 1024,
    "n_heads": 1024,
    "n_kv_heads": 1024,
    "vocab_size": 1 << 22,
    "hidden_dim": 1 << 18,
    "max_seq_len": 1 << 22,
}


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    hidden_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    head_dim: Optional[int] = None
    """Per-head width; `dim // n_heads` when not set."""
    rope_scaling: Optional[RopeScaling] = None
    rope_freq_factors: Optional[tuple[float, ...]] = field(default=None, repr=False)
    """Explicit per-frequency divisors (GGUF's `rope_freqs.weight`); wins over rope_scaling."""
    rope_linear_factor: float = 1.0
    """Linear RoPE scaling (position interpolation): every inverse frequency is divided by
    it, after rope_scaling or rope_freq_factors (HF ``rope_type: linear``, GGUF
    ``rope.scaling.factor``)."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2/2.5; HF Llama's ``attention_bias``)."""
    o_bias: bool = False
    """A bias on the attention output projection (HF Llama's and Qwen3's ``attention_bias``)."""
    qk_norm: bool = False
    """An RMSNorm over each head of q and of k before RoPE (Qwen3), ``norm_eps`` as the others."""
    rotary_dim: Optional[int] = None
    """How many channels of each head RoPE rotates (partial rotary: Phi-4-mini rotates 96 of
    128); the rest pass through. None: the whole head."""
    sliding_window: Optional[int] = None
    """Sliding-window attention: a position sees the ``sliding_window`` positions ending at
    itself (Mistral, Qwen's and Phi-3's option), on ``sliding_layers``."""
    sliding_layers: Optional[tuple[int, ...]] = None
    """The layers that slide; None with a window: every layer."""
    rope_attention_factor: float = 1.0
    """A factor on RoPE's cos and sin (LongRoPE's attention scaling): it scales the rotated
    channels of q and k, so their dot products by its square."""
    rope_local_theta: Optional[float] = None
    """RoPE base of the sliding layers when it differs from the others' (Gemma 3: 1e4 local,
    1e6 global); they get a second table of their own, with no scaling. None: one table."""
    embedding_multiplier: float = 1.0
    """A factor on the token embeddings before the first layer (Gemma: sqrt(dim)); the tied
    output layer reads the table unscaled."""
    ffn_activation: str = "silu"
    """The gated MLP's activation: ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU with the tanh
    approximation of GELU: Gemma)."""
    sandwich_norms: bool = False
    """An RMSNorm on the attention's and the MLP's outputs too, before each is added to the
    residual (Gemma 2/3's post-attention and post-feedforward norms)."""
    attention_scale: Optional[float] = None
    """The factor on ``q . k`` when it is not ``head_dim ** -0.5`` (Gemma's
    ``query_pre_attn_scalar ** -0.5``)."""
    attn_softcap: Optional[float] = None
    """Attention scores become ``cap * tanh(scores / cap)`` (Gemma 2)."""
    final_softcap: Optional[float] = None
    """Logits become ``cap * tanh(logits / cap)`` (Gemma 2)."""

    def __post_init__(self) -> None:
        problems = []
        for name, limit in _LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
                problems.append(f"{name}={value!r} is outside 1..{limit}")
        if problems:  # the checks below assume sane sizes
            raise ValueError("invalid Llama config: " + "; ".join(problems))
        if not (isinstance(self.rope_theta, (int, float)) and 0 < self.rope_theta < float("inf")):
            problems.append(f"rope_theta={self.rope_theta!r} must be a positive number")
        if not (isinstance(self.rope_linear_factor, (int, float)) and 0 < self.rope_linear_factor < float("inf")):
            problems.append(f"rope_linear_factor={self.rope_linear_factor!r} must be a positive number")
        if self.head_dim is not None and not 0 < self.head_dim <= 4096:
            problems.append(f"head_dim={self.head_dim} is outside 1..4096")
        if self.n_heads <= 0 or self.n_kv_heads <= 0:
            problems.append("n_heads and n_kv_heads must be positive")
        elif self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim is None and self.n_heads > 0 and self.dim % self.n_heads:
            problems.append(f"dim={self.dim} is not a multiple of n_heads={self.n_heads}")
        if self.resolved_head_dim % 2:
            problems.append(f"head_dim={self.resolved_head_dim} must be even for RoPE")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.resolved_head_dim and self.rotary_dim % 2 == 0):
            problems.append(f"rotary_dim={self.rotary_dim} must be even and within 2..head_dim {self.resolved_head_dim}")
        if not (isinstance(self.rope_attention_factor, (int, float)) and 0 < self.rope_attention_factor < float("inf")):
            problems.append(f"rope_attention_factor={self.rope_attention_factor!r} must be a positive number")
        if self.sliding_window is not None and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            problems.append(f"sliding_window={self.sliding_window!r} must be a positive number of positions")
        if self.sliding_layers is not None and any(not 0 <= i < self.n_layers for i in self.sliding_layers):
            problems.append(f"sliding_layers {self.sliding_layers} name layers outside 0..{self.n_layers - 1}")
        for name in ("rope_local_theta", "attention_scale", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                problems.append(f"{name}={value!r} must be a positive number")
        if not (isinstance(self.embedding_multiplier, (int, float)) and 0 < self.embedding_multiplier < float("inf")):
            problems.append(f"embedding_multiplier={self.embedding_multiplier!r} must be a positive number")
        if self.ffn_activation not in FFN_ACTIVATIONS:
            problems.append(f"ffn_activation={self.ffn_activation!r} is not one of {', '.join(FFN_ACTIVATIONS)}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.resolved_rotary_dim // 2:
            problems.append(
                f"{len(self.rope_freq_factors)} RoPE frequency factors for {self.resolved_rotary_dim} rotated "
                f"channels (expected {self.resolved_rotary_dim // 2})"
            )
        if problems:
            raise ValueError("invalid Llama config: " + "; ".join(problems))

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // max(self.n_heads, 1)

    def window_of(self, layer: int) -> Optional[int]:
        """The sliding window of ``layer``, or None when it attends to every earlier position."""
        if self.sliding_window is None or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return None
        return self.sliding_window

    @property
    def resolved_rotary_dim(self) -> int:
        return self.rotary_dim if self.rotary_dim is not None else self.resolved_head_dim

    def with_max_seq_len(self, max_seq_len: Optional[int]) -> "LlamaConfig":
        return self if not max_seq_len else replace(self, max_seq_len=int(max_seq_len))


CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=320,  # the tiny byte-level tokenizer: 256 bytes + 61 merges + 3 specials
        hidden_dim=192,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_seq_len=128,
        tie_embeddings=True,
    ),
    # HuggingFaceTB/SmolLM2-135M(-Instruct), as its GGUF metadata states it.
    "smollm2-135m": LlamaConfig(
        dim=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        vocab_size=49152,
        hidden_dim=1536,
        norm_eps=1e-5,
        rope_theta=100000.0,
        max_seq_len=8192,
        tie_embeddings=True,
    ),
}

CONFIG_DESCRIPTIONS: dict[str, str] = {
    "tiny": "dim 64, 2 layers, 4 heads / 2 kv heads, vocab 320 (byte-level BPE), 128 positions, tied",
    "smollm2-135m": "SmolLM2-135M shape: dim 576, 30 layers, 9/3 heads, ffn 1536, vocab 49152, "
    "rope theta 1e5, 8192 positions, tied",
}


def hidden_dim_from_meta_params(dim: int, multiple_of: int = 256, ffn_dim_multiplier: Optional[float] = None) -> int:
    """The SwiGLU width Meta's reference code derives from `params.json`."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)
