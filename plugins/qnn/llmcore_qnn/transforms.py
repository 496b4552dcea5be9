"""Source rewrites that put a model into the shapes Qualcomm's HTP (Hexagon NPU) runs best.

Both follow what ExecuTorch's own Qualcomm Llama export does to its models, expressed as
llmcore source transforms over any family that attends through
:class:`llmcore.modules.CausalAttention`:

* **single-head attention** (``qnn-single-head-attention``): one multi-head attention
  becomes a loop of ``n_heads`` single-head attentions, each a ``[T, D] x [D, S]`` matmul,
  a finite additive causal mask, a softmax and a ``[T, S] x [S, D]`` matmul, whose
  outputs are concatenated. HTP runs 2-D/3-D matmuls well and large 4-D (batched-head)
  ones poorly, and per-head tensors quantize with per-head ranges. Grouped-query
  attention reads key/value head ``h // (n_heads / n_kv_heads)``: no repeated K/V.
  A program with a KV cache gets the same per-head loop over a plain-PyTorch cache
  (``[S, H, D]`` buffers written with ``index_put_``): the default ``kv-cache``'s
  ``llama::update_cache`` / ``llama::custom_sdpa`` custom ops have no QNN kernels.
* **linear as conv2d** (``qnn-linear-to-conv2d``): every ``nn.Linear`` becomes a 1x1
  ``conv2d`` over ``[M, in, 1, 1]`` (the ``M`` rows as the batch), which HTP executes
  faster than a fully connected op. The module keeps the linear's own ``weight`` and
  ``bias`` Parameters (viewed as ``[out, in, 1, 1]`` at call time), so a weight tied to
  an embedding table stays tied and ``state_dict`` keys keep their meaning.

The mask value is finite (``MASK_VALUE``): ``exp(MASK_VALUE - max)`` is exactly 0 in fp32
and fp16, so the result equals the ``-inf`` mask's, and it survives quantized
(16-bit) activation ranges and fp16 HTP graphs without turning into NaN.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmcore.modules import CausalAttention, replace_modules, refuse_unusual_attention
from llmcore.records import Transformed

MASK_VALUE = -30000.0


def causal_mask(rows: int, cols: int, value: float = MASK_VALUE) -> torch.Tensor:
    """``[rows, cols]``: 0 on and below the diagonal, ``value`` above it."""
    return torch.full((rows, cols), value, dtype=torch.float32).triu(1)


def _head_attention(q, k, v, mask, scale):
    """One head: ``q [T, D]``, ``k``/``v`` ``[S, D]``, additive ``mask [T, S]`` -> ``[T, D]``."""
    scores = torch.matmul(q, k.transpose(0, 1)) * scale + mask
    return torch.matmul(torch.softmax(scores, dim=-1), v)


class SingleHeadAttention(nn.Module):
    """:class:`~llmcore.modules.CausalAttention` (no cache) as a loop of single-head
    attentions. Same interface and result; batch of one (llmcore's calling convention)."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, max_seq_len: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5
        # One spare column: the [:T, :T] slice is never a whole row, so torch.export does
        # not specialise on T == max_seq_len.
        self.register_buffer("mask", causal_mask(max_seq_len, max_seq_len + 1), persistent=False)

    def forward(self, q, k, v, input_pos: Optional[torch.Tensor] = None):
        if input_pos is not None:
            raise ValueError("SingleHeadAttention has no KV cache; it takes no input_pos")
        seq_len = q.shape[1]
        n_rep = self.n_heads // self.n_kv_heads
        mask = self.mask[:seq_len, :seq_len]
        heads = [
            _head_attention(q[0, :, h, :], k[0, :, h // n_rep, :], v[0, :, h // n_rep, :], mask, self.scale)
            for h in range(self.n_heads)
        ]
        return torch.cat(heads, dim=-1).unsqueeze(0)  # [1, T, H * D]


class SingleHeadStaticKVAttention(nn.Module):
    """``llmcore.kv_cache.StaticKVAttention`` (plain-PyTorch cache, ``[S, H, D]``
    buffers written with ``index_put_``) with a per-head attention loop over the cache."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, capacity: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.capacity = capacity
        self.scale = head_dim**-0.5
        shape = (capacity, n_kv_heads, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, q, k, v, input_pos: Optional[torch.Tensor] = None):
        seq_len = q.shape[1]
        start = input_pos[0].item()
        torch._check(start >= 0)
        torch._check(start + seq_len <= self.capacity)
        positions = torch.arange(seq_len) + start
        self.k_cache[positions] = k[0]
        self.v_cache[positions] = v[0]
        end = start + seq_len
        keys, values = self.k_cache.narrow(0, 0, end), self.v_cache.narrow(0, 0, end)  # [end, H_kv, D]
        allowed = torch.arange(end).unsqueeze(0) <= positions.unsqueeze(1)  # [T, end]
        mask = torch.where(allowed, 0.0, MASK_VALUE)
        n_rep = self.n_heads // self.n_kv_heads
        heads = [
            _head_attention(q[0, :, h, :], keys[:, h // n_rep, :], values[:, h // n_rep, :], mask, self.scale)
            for h in range(self.n_heads)
        ]
        return torch.cat(heads, dim=-1).unsqueeze(0)


class Conv2dLinear(nn.Module):
    """An ``nn.Linear`` computed as a 1x1 ``conv2d``; holds the linear's own Parameters."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: ties survive
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features, 1, 1)  # [M, in, 1, 1]
        weight = self.weight.view(self.out_features, self.in_features, 1, 1)
        y = F.conv2d(rows, weight, self.bias)  # [M, out, 1, 1]
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def single_head_attention(module: nn.Module, context) -> nn.Module:
    """The ``qnn-single-head-attention`` transform.

    ``CausalAttention`` (no cache) becomes :class:`SingleHeadAttention`. A cached
    attention, the default ``kv-cache`` (whose ``llama::`` custom ops QNN cannot run) or
    ``kv-cache-static``, becomes :class:`SingleHeadStaticKVAttention`: the program keeps
    the cached calling convention, with a plain-PyTorch cache.
    """
    from llmcore.kv_cache import CustomOpKVAttention, StaticKVAttention

    refuse_unusual_attention(
        module, plugin="qnn", form="the QNN single-head attention",
        fix="export this model for xnnpack (its attention and KV cache implement these), or, for a window, "
        "pass --max-seq-len no longer than the window if the model family allows it.",
    )

    def cached(a) -> nn.Module:
        new = SingleHeadStaticKVAttention(a.n_heads, a.n_kv_heads, a.head_dim, a.capacity)
        if isinstance(a, StaticKVAttention):  # same [S, H, D] layout: keep its buffers
            new.k_cache, new.v_cache = a.k_cache, a.v_cache
        return new

    swapped = replace_modules(
        module,
        lambda m: type(m) is CausalAttention,
        lambda a: SingleHeadAttention(a.n_heads, a.n_kv_heads, a.head_dim, context.max_seq_len),
    )
    custom = replace_modules(module, CustomOpKVAttention, cached)
    swapped += custom + replace_modules(module, StaticKVAttention, cached)
    if swapped == 0:
        raise ValueError(
            "the model has no llmcore.modules.CausalAttention (nor a cached attention of llmcore's "
            "kv-cache transforms) to split into single heads"
        )
    if custom:  # the program no longer calls llama::custom_sdpa
        return Transformed(module, dataclasses.replace(context.convention, use_sdpa_with_kv_cache=False))
    return module


def linear_to_conv2d(module: nn.Module, context=None) -> nn.Module:
    """The ``qnn-linear-to-conv2d`` transform."""
    replace_modules(module, lambda m: type(m) is nn.Linear, Conv2dLinear)
    return module
