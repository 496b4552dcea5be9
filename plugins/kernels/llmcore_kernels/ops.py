"""Importing this module registers the llmcore-kernels operators with PyTorch (eager and
``torch.export``) and with the ExecuTorch runtime of this process.

It is the ``python_module`` of the plugin's ``RuntimeLibrary``: llmcore imports it in the
exporting process and before it runs a program that calls ``llmcore::`` operators. The
import raises ``LlmcoreError`` (fix: ``make runner``) when the native library is not built.

Operators (schemas are defined in C++, ``csrc/rms_norm_aten.cpp`` and ``csrc/int4_mlp_aten.cpp``):

``llmcore::rms_norm(Tensor input, Tensor weight, float eps) -> Tensor``
    ``input * rsqrt(mean(input**2, -1) + eps) * weight``, computed in float32 for 16-bit
    inputs; ``input`` and ``weight`` of one floating dtype, ``weight`` 1-D.
``llmcore::rms_norm.out(..., *, Tensor(a!) out) -> Tensor(a!)``
    the same into ``out``: what ``to_executorch`` emits, and the ExecuTorch kernel's name.
``llmcore::int4_mlp(Tensor x, Tensor gate_up, Tensor gate_up_scales, Tensor gate_up_sums, Tensor down, Tensor down_scales, Tensor down_sums) -> Tensor``
    ``down(silu(gate(x)) * up(x))`` with int4 weights and int8 activations rounded per row
    (``csrc/int4_mlp.h``; the packed layout: ``csrc/int4_gemm.h``); ``.out`` as above.
``llmcore::int4_pack(Tensor q) -> Tensor``
    int8 integers in [-8, 7], ``[rows, k]`` (or the same two to a byte, uint8 ``[rows, k/2]``),
    packed as ``int4_mlp`` reads them, ``[rows, k/32, 16]`` uint8 (:func:`llmcore_kernels.mlp.pack`;
    the export's, not a program's, operator).
``llmcore::block_round_least_error(Tensor w, Tensor energy, Tensor multipliers, int block, int qmin, int qmax) -> (Tensor, Tensor, Tensor)``
    ``w [rows, in]`` rounded by blocks of ``block`` (a multiple of 8): each block's scale the
    candidate (its largest ``|w|`` times each of ``multipliers``, rounded to bfloat16) of the
    least ``sum_j energy_j (w_j - d*q_j)^2`` (``energy [in/block, block]``), ``q`` being
    ``w/d`` rounded into ``[qmin, qmax]``; returns ``q`` int8 ``[rows, in]``, the scales
    ``[rows, in/block]`` and float64 ``[sum (d q - w)^2, sum w^2]``: the 8da4w recipe's
    activation-aware rounding (:func:`llmcore_xnnpack.qlinear.int4_blocks_activation_aware`;
    an export's operator, ``csrc/scale_search_aten.cpp``).
``llmcore::int4_norm_qkv_rope`` (``llmcore::int4_norm_qkv_norm_rope``), ``llmcore::int4_linear_add``, ``llmcore::int4_norm_mlp_add``, ``llmcore::int4_linear``
    a Llama layer's work outside attention, and a linear on the same GEMM for the output layer
    after the layers (``csrc/int4_layer.h``; ``int4_linear(x, w, w_scales, w_sums, w_bias?,
    w_offsets?)``). Each projection is three tensors: int4 blocks packed (``[rows, in/32, 16]``
    uint8, bfloat16 scales ``[rows, in/32]``) or int8 rows (``[rows, in]`` int8, float32 scales
    ``[rows]``), and float32 row sums. q, k and v are one projection, or q and k one and v its
    own (``v_weight, v_scales, v_sums, v_offsets?``, last): a Q4_K_M GGUF's int8 v beside int4
    q and k.
    The output layer's may also hold a GGUF's Q6_K super-blocks as the file does
    (``[rows, in/256, 210]`` uint8, each with its float16 ``d``; the scales an empty float16 tensor).
``llmcore::q6_k_embedding(Tensor weight, Tensor indices) -> Tensor``
    rows ``indices`` of such a Q6_K table as float32 ``[*indices.shape, in]``: the lookups of a
    token table tied to the output layer, reading the same tensor.
``llmcore::int4_linear_norm_add(x, w, w_scales, w_sums, w_offsets?, norm_weight, eps, residual)``
    ``residual + rms_norm(x W^T)``: the attention's output projection of a layer with sandwich
    norms (Gemma 2 and 3).
``llmcore::int4_norm_glu_add(h, norm_weight, eps, gate_up..., down..., activation, post_norm_weight?, post_eps)``
    ``h + post_norm(down(act(gate) * up))`` on ``rms_norm(h)``, ``act`` ``"silu"`` or
    ``"gelu_tanh"`` (Gemma's GeGLU), the post-norm only when its weight is given.
``llmcore::int4_layer_norm_linear(h, norm_weight, norm_bias?, eps, w, w_scales, w_sums, w_bias?, w_offsets?)``
    ``layer_norm(h) W^T + bias``: a pre-LayerNorm layer's q, k and v in one GEMM (GPT-2).
``llmcore::int4_linear_bias_add(x, w, w_scales, w_sums, w_bias?, w_offsets?, residual)``
    ``residual + x W^T + bias``: its output projection.
``llmcore::int4_layer_norm_ffn_add(h, norm_weight, norm_bias?, eps, up..., up_bias?, up_offsets?, down..., down_bias?, down_offsets?, activation)``
    ``h + down(act(up(layer_norm(h))))``, each projection with its bias: its plain MLP.
"""

from __future__ import annotations

import torch

from llmcore_kernels import library
from llmcore_xnnpack.qlinear import Q6_K_BYTES, Q6_K_VALUES

library.load()


# Shapes for torch.export's fake tensors: a new contiguous tensor shaped like the input
# (its sizes stay symbolic, so the sequence length stays dynamic).
@torch.library.register_fake("llmcore::rms_norm")
def _rms_norm_fake(input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    torch._check(weight.dim() == 1)
    torch._check(input.shape[-1] == weight.shape[0])
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def rms_norm(input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.llmcore.rms_norm.default(input, weight, eps)


@torch.library.register_fake("llmcore::int4_mlp")
def _int4_mlp_fake(x, gate_up, gate_up_scales, gate_up_sums, down, down_scales, down_sums) -> torch.Tensor:
    torch._check(x.shape[-1] == _in_features(gate_up))
    torch._check(down.shape[0] == x.shape[-1])
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _in_features(w: torch.Tensor) -> int:
    """A projection's inputs: int4 blocks packed ``[rows, in/32, 16]`` uint8, int8 rows
    ``[rows, in]``, or Q6_K super-blocks ``[rows, in/256, 210]`` uint8 (csrc/int4_gemm.h)."""
    if w.dtype == torch.int8:
        torch._check(w.dim() == 2)
        return w.shape[1]
    torch._check(w.dim() == 3)
    return (Q6_K_VALUES if w.shape[2] == Q6_K_BYTES else 32) * w.shape[1]


@torch.library.register_fake("llmcore::q6_k_embedding")
def _q6_k_embedding_fake(weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    torch._check(weight.dim() == 3 and weight.shape[2] == Q6_K_BYTES)
    return indices.new_empty((*indices.shape, Q6_K_VALUES * weight.shape[1]), dtype=torch.float32)


def _head_sizes(h: torch.Tensor, heads: int, head_dim: int) -> list:
    return [*h.shape[:-1], heads, head_dim]


@torch.library.register_fake("llmcore::int4_norm_qkv_rope")
def _int4_norm_qkv_rope_fake(h, norm_weight, eps, qkv, qkv_scales, qkv_sums, qkv_bias, qkv_offsets, cos, sin,
                              n_heads, n_kv_heads, v_weight=None, v_scales=None, v_sums=None, v_offsets=None):
    torch._check(h.shape[-1] == _in_features(qkv))
    heads = n_heads + (2 if v_weight is None else 1) * n_kv_heads  # v's rows in qkv, or apart
    head_dim = qkv.shape[0] // heads
    torch._check(head_dim * heads == qkv.shape[0])
    if v_weight is not None:
        torch._check(v_weight.shape[0] == n_kv_heads * head_dim and _in_features(v_weight) == h.shape[-1])
    return (h.new_empty(_head_sizes(h, n_heads, head_dim)), h.new_empty(_head_sizes(h, n_kv_heads, head_dim)),
            h.new_empty(_head_sizes(h, n_kv_heads, head_dim)))


@torch.library.register_fake("llmcore::int4_norm_qkv_norm_rope")
def _int4_norm_qkv_norm_rope_fake(h, norm_weight, eps, qkv, qkv_scales, qkv_sums, qkv_bias, qkv_offsets, q_norm,
                                   k_norm, qk_eps, cos, sin, n_heads, n_kv_heads, v_weight=None, v_scales=None,
                                   v_sums=None, v_offsets=None):
    return _int4_norm_qkv_rope_fake(h, norm_weight, eps, qkv, qkv_scales, qkv_sums, qkv_bias, qkv_offsets, cos, sin,
                                    n_heads, n_kv_heads, v_weight, v_scales, v_sums, v_offsets)


@torch.library.register_fake("llmcore::int4_linear_add")
def _int4_linear_add_fake(x, w, w_scales, w_sums, w_offsets, residual) -> torch.Tensor:
    torch._check(x.shape[-1] == _in_features(w))
    torch._check(residual.shape[-1] == w.shape[0])
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


@torch.library.register_fake("llmcore::int4_linear")
def _int4_linear_fake(x, w, w_scales, w_sums, w_bias, w_offsets) -> torch.Tensor:
    torch._check(x.shape[-1] == _in_features(w))
    return x.new_empty([*x.shape[:-1], w.shape[0]])


@torch.library.register_fake("llmcore::int4_norm_mlp_add")
def _int4_norm_mlp_add_fake(h, norm_weight, eps, gate_up, gate_up_scales, gate_up_sums, gate_up_offsets, down,
                            down_scales, down_sums, down_offsets) -> torch.Tensor:
    torch._check(h.shape[-1] == _in_features(gate_up))
    torch._check(down.shape[0] == h.shape[-1] and _in_features(down) * 2 == gate_up.shape[0])
    return torch.empty_like(h, memory_format=torch.contiguous_format)


@torch.library.register_fake("llmcore::int4_linear_norm_add")
def _int4_linear_norm_add_fake(x, w, w_scales, w_sums, w_offsets, norm_weight, eps, residual) -> torch.Tensor:
    torch._check(x.shape[-1] == _in_features(w))
    torch._check(residual.shape[-1] == w.shape[0] and norm_weight.shape[0] == w.shape[0])
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


@torch.library.register_fake("llmcore::int4_norm_glu_add")
def _int4_norm_glu_add_fake(h, norm_weight, eps, gate_up, gate_up_scales, gate_up_sums, gate_up_offsets, down,
                            down_scales, down_sums, down_offsets, activation, post_norm_weight,
                            post_eps) -> torch.Tensor:
    torch._check(h.shape[-1] == _in_features(gate_up))
    torch._check(down.shape[0] == h.shape[-1] and _in_features(down) * 2 == gate_up.shape[0])
    return torch.empty_like(h, memory_format=torch.contiguous_format)


@torch.library.register_fake("llmcore::int4_linear_bias_add")
def _int4_linear_bias_add_fake(x, w, w_scales, w_sums, w_bias, w_offsets, residual) -> torch.Tensor:
    torch._check(x.shape[-1] == _in_features(w))
    torch._check(residual.shape[-1] == w.shape[0])
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


@torch.library.register_fake("llmcore::int4_layer_norm_linear")
def _int4_layer_norm_linear_fake(h, norm_weight, norm_bias, eps, w, w_scales, w_sums, w_bias,
                                 w_offsets) -> torch.Tensor:
    torch._check(h.shape[-1] == _in_features(w) and norm_weight.shape[0] == h.shape[-1])
    return h.new_empty([*h.shape[:-1], w.shape[0]])


@torch.library.register_fake("llmcore::int4_layer_norm_ffn_add")
def _int4_layer_norm_ffn_add_fake(h, norm_weight, norm_bias, eps, up, up_scales, up_sums, up_bias, up_offsets, down,
                                  down_scales, down_sums, down_bias, down_offsets, activation) -> torch.Tensor:
    torch._check(h.shape[-1] == _in_features(up))
    torch._check(down.shape[0] == h.shape[-1] and _in_features(down) == up.shape[0])
    return torch.empty_like(h, memory_format=torch.contiguous_format)
