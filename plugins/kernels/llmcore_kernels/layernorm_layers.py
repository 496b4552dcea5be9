"""GPT-2's layers on llmcore's kernels: a pre-LayerNorm block with biases and a plain MLP.

A layer then runs as

    y    = llmcore::int4_layer_norm_linear(h)    # ln_1, then q, k and v in one GEMM, their biases
    a    = the block's attention module          # q, k, v split from y; no RoPE (learned positions)
    h    = llmcore::int4_linear_bias_add(a, h)   # the output projection, its bias, the residual
    h    = llmcore::int4_layer_norm_ffn_add(h)   # ln_2, up + bias, GELU, down + bias, the residual

with no XNNPACK delegate inside it, as a Llama layer on :mod:`.layers`' operators
(``csrc/int4_layer.h``). The operators are new forms, not the Llama ones with switches: those
take RMSNorms without a bias and a gated MLP, and their schemas stay as older programs call them.

A block qualifies when it has GPT-2's parts (``ln_1``; ``attn`` with ``c_attn``, one linear
or :class:`~llmcore_nanogpt.model.SplitQKV`'s ``q``, ``k`` and ``v``, ``c_proj``, an ``attn``
submodule, ``n_head`` and ``head_dim``; ``ln_2``; ``mlp`` with ``c_fc`` and ``c_proj`` and the
``activation`` it names), its norms LayerNorms, its MLP's activation one the kernels compute
(the tanh GELU, or SiLU), every projection int4 with blocks of 32 (with or without offsets)
or int8 per channel, biases on all of q, k and v or none, and when, on a random input with a
plain causal attention in place of its own, the kernels give what the block gives.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from llmcore.modules import CausalAttention, LayerNorm
from llmcore_kernels import mlp
from llmcore_kernels.layers import ACTIVATIONS, CHECK_TOLERANCE, stacked_bias
from llmcore_xnnpack.qlinear import relative_error

PARTS = ("ln_1", "attn", "ln_2", "mlp")
LAYER_NORMS = (LayerNorm, nn.LayerNorm)


def is_block(module: nn.Module) -> bool:
    return (all(hasattr(module, p) for p in PARTS)
            and all(hasattr(module.attn, n) for n in ("c_attn", "c_proj", "attn", "n_head", "head_dim"))
            and all(hasattr(module.mlp, n) for n in ("c_fc", "c_proj")))


def qkv_linears(attention: nn.Module) -> list[nn.Module]:
    """``c_attn`` as the linears whose rows are q's, k's and v's: itself, or SplitQKV's three."""
    fused = attention.c_attn
    parts = [getattr(fused, n, None) for n in ("q", "k", "v")]
    return parts if all(p is not None for p in parts) else [fused]


class KernelLayerNormBlock(nn.Module):
    """A GPT-2 block (``forward(x, input_pos)``) on llmcore's three operators for it, from a
    block whose projections are ``BlockInt4Linear`` or ``ChannelInt8Linear``; its attention
    module is kept."""

    def __init__(self, block: nn.Module):
        super().__init__()
        attention = block.attn
        self.n_heads, self.head_dim = int(attention.n_head), int(attention.head_dim)
        self.attn = attention.attn
        for name in ("ln_1", "ln_2"):
            norm = getattr(block, name)
            self.register_buffer(name, norm.weight.detach().float().contiguous())
            self.register_buffer(f"{name}_bias", None if norm.bias is None else norm.bias.detach().float().contiguous())
            setattr(self, f"{name}_eps", float(norm.eps))
        # (name, the linears whose rows it stacks): q's rows, then k's, then v's, as c_attn's
        for name, linears in (("qkv", qkv_linears(attention)), ("wo", [attention.c_proj]),
                              ("up", [block.mlp.c_fc]), ("down", [block.mlp.c_proj])):
            mlp.register_linears(self, name, linears)
            setattr(self, f"{name}_bias", stacked_bias(linears))
        self.activation = ACTIVATIONS[block.mlp.activation]

    def _projection(self, name: str) -> tuple:
        """The five tensors the operators take for one projection: weight, scales, sums, bias, offsets."""
        return tuple(getattr(self, f"{name}{suffix}") for suffix in ("", "_scales", "_sums", "_bias", "_offsets"))

    def forward(self, x: torch.Tensor, input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = torch.ops.llmcore.int4_layer_norm_linear.default(
            x, self.ln_1, self.ln_1_bias, self.ln_1_eps, *self._projection("qkv"))
        q, k, v = y.split(self.n_heads * self.head_dim, dim=-1)
        shape = (x.shape[0], -1, self.n_heads, self.head_dim)  # -1: the sequence, kept dynamic
        a = self.attn(q.view(shape), k.view(shape), v.view(shape), input_pos)
        h = torch.ops.llmcore.int4_linear_bias_add.default(a, *self._projection("wo"), x)
        return torch.ops.llmcore.int4_layer_norm_ffn_add.default(
            h, self.ln_2, self.ln_2_bias, self.ln_2_eps, *self._projection("up"), *self._projection("down"),
            self.activation)

    def extra_repr(self) -> str:
        kinds = sorted({"int8 rows" if w.dtype == torch.int8 else f"int4 blocks of {mlp.BLOCK}"
                        for w in (self.qkv, self.wo, self.up, self.down)})
        return f"heads {self.n_heads}, {' and '.join(kinds)}, LayerNorms, {self.activation}"


def why_not(block: nn.Module) -> Optional[str]:
    """Why the kernels cannot take this block, or None (before the numerical check)."""
    for name in ("ln_1", "ln_2"):
        norm = getattr(block, name)
        if not isinstance(norm, LAYER_NORMS) or norm.weight is None or norm.weight.dim() != 1:
            return f"its {name} is a {type(norm).__name__}, not a LayerNorm with a weight over the last dimension"
    activation = getattr(block.mlp, "activation", None)
    if activation not in ACTIVATIONS:
        return (f"its MLP's activation is {getattr(activation, '__name__', 'not named')}, "
                f"not one of {', '.join(ACTIVATIONS.values())}")
    attention = block.attn
    stacked = qkv_linears(attention)
    roles = [(f"c_attn{'.' + n if len(stacked) == 3 else ''}", p) for n, p in zip("qkv", stacked)]
    roles += [("attention's c_proj", attention.c_proj), ("MLP's c_fc", block.mlp.c_fc),
              ("MLP's c_proj", block.mlp.c_proj)]
    for role, p in roles:
        reason = mlp.why_not_linear(role, p, offsets=True, int8=True)
        if reason is not None:
            return reason
    if len({type(p) for p in stacked}) > 1:
        return "its q, k and v projections are of different kinds (int4 and int8)"
    if len({p.bias is None for p in stacked}) > 1:
        return "only some of q, k and v have a bias"
    up, down = block.mlp.c_fc, block.mlp.c_proj
    if up.out_features % mlp.BLOCK or down.in_features != up.out_features or down.out_features != up.in_features:
        return f"its MLP's hidden size is not a multiple of {mlp.BLOCK}, or c_proj does not map it back"
    if sum(p.out_features for p in stacked) != 3 * attention.n_head * attention.head_dim:
        return "its c_attn does not hold q, k and v of n_head heads"
    return None


def same_function(block: nn.Module, layer: KernelLayerNormBlock) -> Optional[str]:
    """None when ``layer`` computes what ``block`` does on a random input of 3 tokens, each
    with a plain causal attention in place of its own (a KV cache would keep the input)."""
    attention = block.attn
    plain = CausalAttention(layer.n_heads, layer.n_heads, layer.head_dim)
    x = torch.randn(1, 3, layer.ln_1.shape[0], generator=torch.Generator().manual_seed(0))
    kept_block, kept_layer = attention.attn, layer.attn
    attention.attn, layer.attn = plain, plain
    try:
        with torch.no_grad():
            expected = block(x, None)
            got = layer(x, None)
    finally:
        attention.attn, layer.attn = kept_block, kept_layer
    error = relative_error(got - x, expected - x)  # the layer's own contribution, not the residual's
    return None if error <= CHECK_TOLERANCE else f"differs from the kernels by {error:.2g} (relative)"
