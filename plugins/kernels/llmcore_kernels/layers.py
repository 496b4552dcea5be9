"""Recipes ``8da4w-layers``, ``gguf-layers`` and ``8da8w-layers``: 8da4w's integers (or a
GGUF's own, or 8da8w's int8 ones), each Llama layer's quantized work on llmcore's kernels.

A layer then runs as

    q, k, v = llmcore::int4_norm_qkv_rope(h)     # attention norm, q/k/v in one GEMM, RoPE
    a       = the layer's attention module        # KV-cache ops (llama::update_cache, custom_sdpa)
    h       = llmcore::int4_linear_add(a, wo, h)  # output projection + residual
    h       = llmcore::int4_norm_mlp_add(h)       # ffn norm, SwiGLU MLP, residual

with no XNNPACK delegate inside it (``csrc/int4_layer.h`` says why). A layer with norms on
each sublayer's output (Gemma 2 and 3's sandwich norms) or a GeGLU MLP (Gemma's) runs its
last two steps as ``llmcore::int4_linear_norm_add`` (``h = x + post_norm(wo a)``) and
``llmcore::int4_norm_glu_add`` (``h + post_norm(mlp(norm(h)))``, the MLP's activation
named). After the layers, the final norm becomes ``llmcore::rms_norm`` (:mod:`.rmsnorm`) and
the output layer (int8 per channel, int4 blocks, a GGUF's Q8_0 blocks or its Q6_K super-blocks
as the file holds them) ``llmcore::int4_linear`` on the same GEMM (:class:`KernelLinear`; a Q6_K
table's lookups ``llmcore::q6_k_embedding``, :class:`KernelQ6KEmbedding`), so that no XNNPACK
delegate is left: its AVX2 int8 GEMM read
SmolLM2's 28 MB output layer more slowly than llmcore's reads the MLPs (docs/performance.md,
"The output layer on llmcore's GEMM"). A quantized linear the GEMM cannot take stays with
XNNPACK.

A layer qualifies when it is a pre-norm Llama block (``attention_norm``, ``attention`` with
``wq wk wv wo`` and an ``attn`` submodule, ``ffn_norm``, ``feed_forward``), its norms RMSNorms
(post-norms too, when it has them), its MLP's activation SiLU or the tanh GELU, q/k norms only
as RMSNorms over each head (Qwen3's and Gemma 3's: those layers' first step is
``llmcore::int4_norm_qkv_norm_rope``, which norms each head before RoPE), its MLP one :mod:`.mlp` takes, every
projection int4 with blocks of 32 (with or without per-block offsets) or int8 per channel (the
operators' int8 rows; one kind for q and k, v of theirs or the other, as a Q4_K_M GGUF's Q6_K v
beside Q4_K q and k; one kind for gate and up), no outlier split, no bias
but on q, k and v (Qwen2's), and when on a random input (with a plain causal attention in place
of its own) the kernels give what the block gives: RoPE on Meta's interleaved pairs passes, a
rotation of the halves would not. The recipe refuses a model with a layer that does not, by
name and reason. GPT-2's layers (LayerNorms, biases, a plain MLP, no RoPE) have operators of
their own: :mod:`.layernorm_layers`, which :func:`swap_layers` applies too.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from llmcore.errors import LlmcoreError
from llmcore.modules import CausalAttention, RMSNorm, gelu_tanh, replace_modules
from llmcore.progress import WEIGHT_TEMPORARIES, heap_for_temporaries
from llmcore_kernels import mlp
from llmcore_xnnpack.qlinear import Q6_K_BYTES, StoredBlocksEmbedding, relative_error

log = logging.getLogger(__name__)

# ||kernels - block|| / ||block|| (the layer's own contribution) allowed by the swap check.
# Wider than the MLP's: the kernels norm in C++ (llmcore::rms_norm's arithmetic) and the
# block in PyTorch, so a normed value may differ by an ulp and round to the neighbouring
# int8 step, and the step travels through attention and the MLP: most layers agree to
# float rounding and the odd one by far more, while a wrong RoPE pairing or norm is off by
# 0.1 and more (docs/custom-kernels.md, "Testing a kernel", has SmolLM2's figures).
CHECK_TOLERANCE = 0.02
PARTS = ("attention_norm", "attention", "ffn_norm", "feed_forward")
POST_NORMS = ("attention_post_norm", "ffn_post_norm")  # Gemma 2 and 3's sandwich norms
# an MLP's activation function -> the name llmcore::int4_norm_glu_add takes
ACTIVATIONS = {torch.nn.functional.silu: "silu", gelu_tanh: "gelu_tanh"}


class KernelLayer(nn.Module):
    """A Llama layer (``forward(x, cos, sin, input_pos)``) on llmcore's three layer operators,
    from a block whose projections are ``BlockInt4Linear`` or ``ChannelInt8Linear`` (the
    operators' int4 blocks and int8 rows); its attention module is kept."""

    def __init__(self, block: nn.Module):
        super().__init__()
        attention = block.attention
        self.n_heads, self.n_kv_heads = attention.n_heads, attention.n_kv_heads
        self.attn = attention.attn
        self.attention_eps, self.ffn_eps = float(block.attention_norm.eps), float(block.ffn_norm.eps)
        self.register_buffer("attention_norm", block.attention_norm.weight.detach().float().contiguous())
        self.register_buffer("ffn_norm", block.ffn_norm.weight.detach().float().contiguous())
        stacked = [attention.wq, attention.wk, attention.wv]  # q's rows, then k's, then v's
        # a v of another kind than q and k (a Q4_K_M GGUF's Q6_K v as int8 rows beside Q4_K q
        # and k) is a projection of its own, passed to the same operator (wv_*; None without)
        self.v_apart = type(attention.wv) is not type(attention.wq)
        mlp.register_linears(self, "qkv", stacked[:2] if self.v_apart else stacked)
        if self.v_apart:
            mlp.register_linears(self, "wv", [attention.wv])
        else:
            for name in ("wv", "wv_scales", "wv_sums", "wv_offsets"):
                self.register_buffer(name, None)
        self.qkv_bias = stacked_bias(stacked)  # q's, k's and v's, v apart or not
        mlp.register_linears(self, "wo", [attention.wo])
        gate, up, down = mlp.projections(block.feed_forward)
        mlp.register_mlp(self, gate, up, down)
        # Qwen3's (and Gemma 3's) per-head norms of q and k, between the projection and RoPE:
        # int4_norm_qkv_norm_rope norms each head once the GEMM has all its columns
        qkv_heads = self.n_heads + (1 if self.v_apart else 2) * self.n_kv_heads
        self.head_dim = self.qkv.shape[0] // qkv_heads  # qkv's rows: whole heads
        q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
        self.qk_eps = None if q_norm is None else float(q_norm.eps)
        self.register_buffer("q_norm", None if q_norm is None else q_norm.weight.detach().float().contiguous())
        self.register_buffer("k_norm", None if k_norm is None else k_norm.weight.detach().float().contiguous())
        # Gemma's norms on the attention's and the MLP's outputs, before each residual add
        for name in POST_NORMS:
            norm = getattr(block, name, None)
            self.register_buffer(name, None if norm is None else norm.weight.detach().float().contiguous())
            setattr(self, f"{name}_eps", None if norm is None else float(norm.eps))
        self.activation = mlp_activation(block.feed_forward)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        v_apart = (self.wv, self.wv_scales, self.wv_sums, self.wv_offsets)  # all None when qkv holds v
        if self.q_norm is None:
            q, k, v = torch.ops.llmcore.int4_norm_qkv_rope.default(
                x, self.attention_norm, self.attention_eps, self.qkv, self.qkv_scales, self.qkv_sums, self.qkv_bias,
                self.qkv_offsets, cos, sin, self.n_heads, self.n_kv_heads, *v_apart,
            )
        else:
            q, k, v = torch.ops.llmcore.int4_norm_qkv_norm_rope.default(
                x, self.attention_norm, self.attention_eps, self.qkv, self.qkv_scales, self.qkv_sums, self.qkv_bias,
                self.qkv_offsets, self.q_norm, self.k_norm, self.qk_eps, cos, sin, self.n_heads, self.n_kv_heads,
                *v_apart,
            )
        a = self.attn(q, k, v, input_pos)
        if self.attention_post_norm is None:
            h = torch.ops.llmcore.int4_linear_add.default(a, self.wo, self.wo_scales, self.wo_sums, self.wo_offsets, x)
        else:
            h = torch.ops.llmcore.int4_linear_norm_add.default(
                a, self.wo, self.wo_scales, self.wo_sums, self.wo_offsets, self.attention_post_norm,
                self.attention_post_norm_eps, x)
        mlp_weights = (self.gate_up, self.gate_up_scales, self.gate_up_sums, self.gate_up_offsets,
                       self.down, self.down_scales, self.down_sums, self.down_offsets)
        if self.activation == "silu" and self.ffn_post_norm is None:  # Llama's: the operator older programs call
            return torch.ops.llmcore.int4_norm_mlp_add.default(h, self.ffn_norm, self.ffn_eps, *mlp_weights)
        return torch.ops.llmcore.int4_norm_glu_add.default(
            h, self.ffn_norm, self.ffn_eps, *mlp_weights, self.activation, self.ffn_post_norm,
            self.ffn_post_norm_eps or 0.0)

    def extra_repr(self) -> str:
        kinds = sorted({"int8 rows" if w.dtype == torch.int8 else f"int4 blocks of {mlp.BLOCK}"
                        for w in (self.qkv, self.wv, self.wo, self.gate_up, self.down) if w is not None})
        post_norms = [name.replace("_", " ") for name in POST_NORMS if getattr(self, name) is not None]
        extras = [self.activation, *post_norms]
        return f"heads {self.n_heads}, kv heads {self.n_kv_heads}, {' and '.join(kinds)}, {', '.join(extras)}"


def mlp_activation(feed_forward: nn.Module) -> Optional[str]:
    """The name of a gated MLP's activation (``ACTIVATIONS``), None for another function. A
    module that does not say (Hugging Face's names) is taken as SiLU: the swap check then
    finds out if it is not."""
    return ACTIVATIONS.get(getattr(feed_forward, "activation", torch.nn.functional.silu))


class KernelLinear(nn.Module):
    """``y = x W^T (+ bias)`` through ``llmcore::int4_linear``, from a ``BlockInt4Linear``,
    ``ChannelInt8Linear`` or ``BlockInt8Linear`` (the output layer): the layer operators' GEMM
    and int8 rounding of the activations (per block of 32 for int4 and int8 blocks, per token
    for int8 rows: csrc/int4_gemm.h, QuantizedRows), the integers unchanged."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        mlp.register_linears(self, "w", [linear])
        self.w_bias = stacked_bias([linear])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llmcore.int4_linear.default(
            x, self.w, self.w_scales, self.w_sums, self.w_bias, self.w_offsets)

    def extra_repr(self) -> str:
        kind = ("Q6_K super-blocks" if self.w.dim() == 3 and self.w.shape[2] == Q6_K_BYTES else
                "Q4_K (int4 blocks, the file's headers)" if self.w_scales.dtype == torch.uint8 else
                f"int4 blocks of {mlp.BLOCK}" if self.w.dtype != torch.int8 else
                f"int8 blocks of {mlp.BLOCK}" if self.w_scales.dim() == 2 else "int8 rows")
        return f"{self.in_features}, {self.out_features}, {kind}"


class KernelQ6KEmbedding(nn.Module):
    """The lookups of a token table tied to an output layer kept as the file's Q6_K
    (:class:`~llmcore_xnnpack.qlinear.StoredBlocksEmbedding`) through ``llmcore::q6_k_embedding``,
    on the tensors the output layer's :class:`KernelLinear` reads: one table in the program."""

    def __init__(self, embedding: nn.Module):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.register_buffer("w", embedding.blocks)  # the output layer's tensor itself

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return torch.ops.llmcore.q6_k_embedding.default(self.w, indices)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, Q6_K super-blocks (the output layer's)"


def stacked_bias(linears: list[nn.Module]) -> Optional[nn.Parameter]:
    """The linears' biases one after another, as their rows are stacked, or None when they have
    none (the callers' checks require all or none)."""
    if linears[0].bias is None:
        return None
    return nn.Parameter(torch.cat([p.bias.detach().float() for p in linears]).contiguous(), requires_grad=False)


def _is_block(module: nn.Module) -> bool:
    return all(hasattr(module, p) for p in PARTS) and all(
        hasattr(module.attention, n) for n in ("wq", "wk", "wv", "wo", "attn", "n_heads", "n_kv_heads"))


def _why_not(block: nn.Module) -> Optional[str]:
    """Why the kernels cannot take this block, or None (before the numerical check)."""
    for name in ("attention_norm", "ffn_norm", *POST_NORMS):
        norm = getattr(block, name, None)
        if norm is None and name in POST_NORMS:  # a layer without sandwich norms
            continue
        if not isinstance(norm, RMSNorm):
            return f"its {name} is a {type(norm).__name__}, not an RMSNorm"
    if mlp_activation(block.feed_forward) is None:
        return f"its MLP's activation is {getattr(block.feed_forward.activation, '__name__', 'another')}, " \
               f"not one of {', '.join(ACTIVATIONS.values())}"
    attention = block.attention
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    if (q_norm is None) != (k_norm is None):
        return "its attention has a norm on only one of q and k"
    if q_norm is not None and not (isinstance(q_norm, RMSNorm) and isinstance(k_norm, RMSNorm)
                                   and q_norm.eps == k_norm.eps):
        return "its q and k norms are not RMSNorms of one eps over each head"
    for role in ("wq", "wk", "wv", "wo"):
        reason = mlp.why_not_linear(role, getattr(attention, role), offsets=True, int8=True)
        if reason is not None:
            return reason
    if type(attention.wq) is not type(attention.wk):  # v may differ: a projection of its own
        return "its q and k projections are of different kinds (int4 and int8)"
    biased = [r for r in ("wq", "wk", "wv") if getattr(attention, r).bias is not None]
    if biased and len(biased) < 3:
        return f"only {', '.join(biased)} of q, k and v have a bias"
    if attention.wo.bias is not None:
        return "its wo has a bias"
    projections = mlp.projections(block.feed_forward)
    if projections is None:
        return "its MLP has no gate, up and down projections"
    return mlp.why_not(*projections, offsets=True, int8=True)


def _same_function(block: nn.Module, layer: KernelLayer) -> Optional[str]:
    """None when ``layer`` computes what ``block`` does on a random input of 3 tokens, each
    with a plain causal attention in place of its own (a KV cache would keep the input)."""
    attention = block.attention
    plain = CausalAttention(attention.n_heads, attention.n_kv_heads, layer.head_dim)
    generator = torch.Generator().manual_seed(0)
    dim = layer.attention_norm.shape[0]
    x = torch.randn(1, 3, dim, generator=generator)
    head_dim = plain.head_dim
    angles = torch.rand(1, 3, 1, head_dim // 2, generator=generator).repeat_interleave(2, dim=-1) * 6.0
    cos, sin = angles.cos(), angles.sin()
    kept_block, kept_layer = attention.attn, layer.attn
    attention.attn, layer.attn = plain, plain
    try:
        with torch.no_grad():
            expected = block(x, cos, sin)
            got = layer(x, cos, sin)
    finally:
        attention.attn, layer.attn = kept_block, kept_layer
    error = relative_error(got - x, expected - x)  # the layer's own contribution, not the residual's
    return None if error <= CHECK_TOLERANCE else f"differs from the kernels by {error:.2g} (relative)"


def _swap_checked(model: nn.Module, match, why_not, build, same_function) -> tuple[int, list[str]]:
    """Replace each submodule ``match`` selects with ``build(module)`` where ``why_not`` gives
    no reason against it and ``same_function(module, built)`` finds them computing the same;
    returns (how many, why others were kept, by name)."""
    from llmcore_kernels import ops  # noqa: F401  registers the operators the modules call

    names = {id(m): n for n, m in model.named_modules()}
    kept: list[str] = []

    def built_or_none(module: nn.Module) -> Optional[nn.Module]:
        reason = why_not(module)
        # one layer's packing and check: their temporaries reuse heap pages, which go back
        # once it is built (llmcore.progress.heap_for_temporaries)
        with heap_for_temporaries(largest=WEIGHT_TEMPORARIES):
            built = None if reason else build(module)
            if reason is None:
                with mlp.computing_as_the_kernels(module):
                    reason = same_function(module, built)
        if reason is not None:
            kept.append(f"{names[id(module)]}: {reason}")
            return None
        return built

    return replace_modules(model, match, built_or_none), kept


def swap_layers(model: nn.Module) -> tuple[int, list[str]]:
    """Replace qualifying layers in place, Llama's (:class:`KernelLayer`) and GPT-2's
    (:class:`~llmcore_kernels.layernorm_layers.KernelLayerNormBlock`); returns (how many, why
    others were kept)."""
    from llmcore_kernels import layernorm_layers as gpt2

    swapped, kept = _swap_checked(model, _is_block, _why_not, KernelLayer, _same_function)
    more, kept_more = _swap_checked(model, gpt2.is_block, gpt2.why_not, gpt2.KernelLayerNormBlock,
                                    gpt2.same_function)
    return swapped + more, kept + kept_more


def is_layer(module: nn.Module) -> bool:
    """A layer :func:`swap_layers` looks at: Llama's or GPT-2's."""
    from llmcore_kernels import layernorm_layers

    return _is_block(module) or layernorm_layers.is_block(module)


def _same_linear(linear: nn.Module, kernel: KernelLinear) -> Optional[str]:
    """None when ``kernel`` computes what ``linear`` does on a random input of 3 rows."""
    x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        error = relative_error(kernel(x), linear(x))
    return None if error <= mlp.CHECK_TOLERANCE else f"differs from the kernel by {error:.2g} (relative)"


def swap_outside_layers(model: nn.Module) -> list[str]:
    """After :func:`swap_layers`: every int4 or int8 linear left (the output layer) onto
    :class:`KernelLinear`, the lookups of a Q6_K table tied to it onto :class:`KernelQ6KEmbedding`,
    every RMSNorm left (the final norm) onto ``llmcore::rms_norm``,
    except inside a layer :func:`swap_layers` kept (it stays whole, for XNNPACK to delegate);
    returns why linears were kept (they stay with XNNPACK)."""
    from llmcore_kernels import rmsnorm

    inside_kept = {id(m) for block in model.modules() if is_layer(block) for m in block.modules()}
    _, kept = _swap_checked(model, lambda m: isinstance(m, mlp.QUANTIZED_LINEARS) and id(m) not in inside_kept,
                            lambda linear: mlp.why_not_linear("linear", linear, offsets=True, int8=True,
                                                              int8_blocks=True),
                            KernelLinear, _same_linear)
    rmsnorm.swap_rms_norms(model, leave=inside_kept)
    replace_modules(model, lambda m: isinstance(m, StoredBlocksEmbedding) and m.format == "Q6_K", KernelQ6KEmbedding)
    return kept


def apply(module: nn.Module, recipe: str, instead: str) -> nn.Module:
    """Swap every layer of ``module``, or raise for ``recipe`` naming the layers that cannot
    be swapped and why; ``instead``: the recipes to suggest (e.g. ``8da4w-mlp or 8da4w``)."""
    swapped, kept = swap_layers(module)
    if swapped == 0 and not kept:
        raise LlmcoreError(
            f"{recipe}: the model has no Llama layers (attention with wq, wk, wv, wo, then a gated MLP) or "
            "GPT-2 layers (ln_1, attn with c_attn and c_proj, ln_2, mlp with c_fc and c_proj) for llmcore's "
            "layer kernels.",
            stage="quantize",
            fix=f"use --quantize {instead} for this model.",
        )
    if kept:
        raise LlmcoreError(
            f"{recipe}: {len(kept)} layer(s) cannot run on llmcore's layer kernels ({'; '.join(kept[:3])}).",
            stage="quantize",
            fix=f"use --quantize {instead} for this model.",
        )
    for reason in swap_outside_layers(module):
        log.info("%s: XNNPACK keeps %s", recipe, reason)
    return module
