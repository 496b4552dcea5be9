"""Building blocks shared by model families.

:class:`CausalAttention` is the seam between a model family and the source transforms:
a family computes ``q``, ``k`` and ``v`` its own way (fused or separate projections,
RoPE or learned positions) and hands them to a ``CausalAttention`` submodule. A KV-cache
transform, or a backend's attention rewrite, replaces that submodule and nothing else, so
the same transform serves every family.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmcore.errors import LlmcoreError


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32 (Llama's).

    Shared so that a backend plugin can recognise it and swap in a form its delegate takes
    without knowing which model family built it."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with an optional bias (``weight``, ``bias`` names)."""

    def __init__(self, dim: int, bias: bool = True, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class CausalAttention(nn.Module):
    """Causal scaled-dot-product attention over ``[B, T, H, D]`` inputs, without a cache.

    ``q`` has ``n_heads`` heads, ``k`` and ``v`` have ``n_kv_heads`` (grouped-query
    attention when fewer). Returns ``[B, T, n_heads * head_dim]``. Beyond plain causal
    attention, and kept the same by the KV-cache transforms:

    * ``window`` (sliding-window attention: Mistral, Gemma's local layers, Qwen's and
      Phi-3's option): a position sees the ``window`` positions ending at itself, as
      transformers defines it (:func:`attention_mask`);
    * ``scale``: the factor on ``q . k`` when it is not ``head_dim ** -0.5`` (Gemma's
      ``query_pre_attn_scalar``);
    * ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the mask and
      the softmax (Gemma 2). No fused SDPA kernel has this, so such a layer attends with
      explicit matmuls (:func:`explicit_attention`).

    A backend transform with its own attention form implements these or refuses the layer
    (:func:`unusual_attention`).
    """

    def __init__(
        self,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        window: Optional[int] = None,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
    ):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
        if window is not None and window < 1:
            raise ValueError(f"window={window} must be a positive number of positions")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap={softcap} must be positive")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.window = window
        self.scale = scale
        self.softcap = softcap

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        input_pos: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        bsz, seq_len = q.shape[0], q.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        if self.softcap is not None:
            positions = torch.arange(seq_len)
            mask = attention_mask(positions, positions, self.window)
            y = explicit_attention(q, k, v, mask, self.scale, self.softcap)
            return y.transpose(1, 2).reshape(bsz, -1, self.n_heads * self.head_dim)
        k, v = repeat_kv(k, self.n_heads // self.n_kv_heads), repeat_kv(
            v, self.n_heads // self.n_kv_heads
        )
        if self.window is None or self.window >= seq_len:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            positions = torch.arange(seq_len)
            mask = attention_mask(positions, positions, self.window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return y.transpose(1, 2).reshape(bsz, -1, self.n_heads * self.head_dim)


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Attention written out, ``softmax(cap(q k^T * scale) + mask) v``, for what fused SDPA
    kernels (``F.scaled_dot_product_attention``, ``llama::custom_sdpa``) cannot do:
    soft-capped scores. ``q`` is ``[B, H, T, D]``, ``k``/``v`` ``[B, H_kv, S, D]``; ``mask``
    is ``[T, S]``, bool (True: may attend) or additive (0 / -inf). Returns ``[B, H, T, D]``.

    Grouped-query heads are not repeated: each kv head's ``H / H_kv`` query heads are
    stacked along the rows (``[B, H_kv, n_rep * T, D]``), so the graph holds only matmuls,
    views and elementwise ops, which XNNPACK lowers (it has no ``expand``). Computed in
    float32."""
    bsz, n_heads, n_kv = q.shape[0], q.shape[1], k.shape[1]
    n_rep, head_dim, keys_len = n_heads // n_kv, q.shape[-1], k.shape[-2]
    scale = head_dim ** -0.5 if scale is None else scale
    # 3-D bmm on views with one inferred dim: torch.matmul on 4-D tensors exports as expand +
    # views to symbolic shapes, which XNNPACK does not lower
    grouped = q.float().contiguous().view(bsz * n_kv, -1, head_dim)  # [B*H_kv, n_rep*T, D]
    keys = k.float().reshape(bsz * n_kv, keys_len, head_dim)
    values = v.float().reshape(bsz * n_kv, keys_len, head_dim)
    scores = torch.bmm(grouped, keys.transpose(1, 2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(bsz * n_kv, n_rep, -1, keys_len)  # [B*H_kv, n_rep, T, S]
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1).view(bsz * n_kv, -1, keys_len)
    out = torch.bmm(probs, values)  # [B*H_kv, n_rep*T, D]
    # split the rows, then merge the heads: one view straight to [B, H, T, D] makes
    # torch.export guard on the (symbolic) strides of the bmm's output
    return out.view(bsz, n_kv, n_rep, -1, head_dim).view(bsz, n_heads, -1, head_dim).type_as(q)


def attention_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """``[T, S]`` bool: query at position ``query_pos[t]`` may see the key at ``key_pos[s]``
    (causal, and within ``window`` positions ending at the query when there is one)."""
    # compared without a [T, S] difference tensor: only bool [T, S] intermediates
    queries, keys = query_pos.unsqueeze(1), key_pos.unsqueeze(0)
    allowed = keys <= queries
    if window is not None:
        allowed = allowed & (keys > queries - window)
    return allowed


def unusual_attention(module: nn.Module) -> list[tuple[str, str]]:
    """``(name, what)`` for each attention submodule, plain or cached, that does more than
    causal attention at the default scale: a sliding window, another scale, soft-capped
    scores (:class:`CausalAttention`). A backend transform that replaces attention with its
    own form must implement these or refuse the layer by name."""
    found = []
    for name, m in module.named_modules():
        if isinstance(getattr(m, "window", None), int):
            found.append((name, "sliding-window attention"))
        elif getattr(m, "softcap", None) is not None:
            found.append((name, "soft-capped attention scores"))
        elif getattr(m, "scale", None) is not None and isinstance(getattr(m, "head_dim", None), int):
            found.append((name, "an attention scale other than 1/sqrt(head_dim)"))
    return found


def refuse_unusual_attention(module: nn.Module, *, plugin: str, form: str, fix: str, allowed=()) -> None:
    """Refuse, by the first layer's name, a model whose attention does more than ``form``
    (a backend's own attention, e.g. "the Vulkan attention forms") implements
    (:func:`unusual_attention`); attention modules of the types in ``allowed`` are left to
    the backend as they are. One message for every backend, so that a user meets the same
    words whichever one refuses."""
    unusual = [(n, what) for n, what in unusual_attention(module)
               if not isinstance(module.get_submodule(n), tuple(allowed))]
    if unusual:
        name, what = unusual[0]
        raise LlmcoreError(f"{name} uses {what}, which {form} does not implement.",
                           stage="transform", plugin=plugin, fix=fix)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (``F.gelu(x, approximate="tanh")``: Gemma's GeGLU),
    written out with muls, adds and a tanh. XNNPACK's GELU operator takes that call but
    computes the exact (erf) GELU whatever ``approximate`` says, which would move every
    activation by up to ~1e-3 without a word; its tanh, muls and adds compute this form."""
    inner = (x + 0.044715 * (x * x * x)) * math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1.0 + torch.tanh(inner))


def static_shape(x: torch.Tensor) -> list[int]:
    """``x.shape`` with its one dynamic (symbolic) dim written as -1.

    A ``view`` to such a shape exports with plain ints, which XNNPACK delegates; a view
    to a symbolic shape stays outside the delegate and splits the graph around it.
    """
    shape = [d if isinstance(d, int) else -1 for d in x.shape]
    return shape if shape.count(-1) <= 1 else list(x.shape)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Repeat ``[B, H_kv, T, D]`` key/value heads ``n_rep`` times along the head axis."""
    if n_rep == 1:
        return x
    return x.repeat_interleave(n_rep, dim=1)


def positions_slice(table: torch.Tensor, seq_len: int, input_pos: Optional[torch.Tensor]):
    """Rows ``[start, start + seq_len)`` of a per-position table (embeddings, RoPE freqs).

    ``start`` is 0 without a cache and ``input_pos[0]`` with one. Slicing keeps the graph
    free of ``arange`` and advanced indexing, which some backends cannot lower.
    """
    if input_pos is None:
        return table[:seq_len]
    start = input_pos[0].item()
    torch._check(start >= 0)
    torch._check(start + seq_len <= table.shape[0])
    return table.narrow(0, start, seq_len)


def replace_modules(
    root: nn.Module,
    match: "type | tuple[type, ...] | Callable[[nn.Module], bool]",
    make: Callable[[nn.Module], Optional[nn.Module]],
) -> int:
    """Replace every submodule of ``root`` that ``match`` selects with ``make(child)``, in
    place; returns how many were replaced.

    ``match`` is a class (or a tuple of classes) that selects its instances, or a predicate
    on a module. ``make`` returns the replacement, or ``None`` to keep that module (a
    transform that checks each candidate first). A replaced module is not searched further;
    every other child is, at any depth. ``root`` itself is never replaced.

    This is how source transforms swap one module kind for another (a cached attention for
    :class:`CausalAttention`, a backend's form of a norm)::

        replace_modules(model, CausalAttention, lambda a: MyAttention(a.n_heads, a.n_kv_heads, a.head_dim))
    """
    if isinstance(match, (type, tuple)):
        kinds = match
        match = lambda module: isinstance(module, kinds)  # noqa: E731
    replaced = 0
    # by name, not over a list of the children: each replaced module is freed as soon as it
    # is swapped, not when the last sibling is (a model's layers, one at a time)
    for name in [name for name, _ in root.named_children()]:
        child = getattr(root, name)
        new = make(child) if match(child) else None
        if new is not None:
            setattr(root, name, new)
            replaced += 1
        else:
            replaced += replace_modules(child, match, make)
    return replaced
