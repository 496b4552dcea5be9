"""Linear layers with int8 activations and int4 / int8 weights, in the graph forms XNNPACK runs.

XNNPACK's partitioner turns two patterns into one dynamically quantized GEMM each (the
activations quantized to int8 per token at run time, "qd8"):

* blockwise 4-bit weights (qb4w): integers in [-8, 7], one scale per block of input features,
  no zero point: ``dequantize_per_channel_group`` of an int8 tensor;
* channelwise 8-bit weights (qc8w): integers in [-127, 127], one scale per output channel:
  ``dequantize_per_channel``.

These modules write those patterns with the ``quantized_decomposed`` ops, from integers and
scales the caller chose, rather than through torchao's tensor subclasses, for two reasons:

1. A quantized checkpoint's own integers go in unchanged (the ``gguf`` recipe), and an
   asymmetric format (a GGUF's Q4_1: ``w = d*u + m``) runs on the symmetric kernel as
   ``d*(u - 8)`` plus an offset term per block (``(m + 8d) * sum(x over the block)``): a
   mean over each block, shared by the layers reading the same input, and a small fp32 GEMM
   ``in/32`` columns wide, beside the int4 one.
2. Lowering is faster: the ``quantized_decomposed`` ops have plain shape functions, while
   torchao's ``choose_qparams_affine`` is traced in Python on every one of the ~20 times
   lowering re-traces the graph (docs/performance.md, "Measurements behind the code").

Per-token int8 activations are most of what a 4-bit program loses next to its source: one scale
for 576 or 1536 values, set by the token's few outliers, leaves the rest a handful of levels.
With ``outlier_split`` a layer instead runs its GEMM on two rows per token (see
:func:`split_outliers`): the token clamped to an eighth of its largest magnitude, and what the
clamp removed (zero except at the outliers). Each row gets its own int8 scale from XNNPACK's
own per-token quantization, and the two products add up to the product with ``x``. On
SmolLM2's Q4_1 GGUF it brings the mean KL divergence from the fp32 model's next-token
distribution down to what per-32 int8 blocks, as llama.cpp quantizes activations, give. It
is not the default of the 4-bit recipes because XNNPACK's int4 GEMM takes as long for two
rows as for two tokens, even at decode, and the split adds ~10 small operators per input:
decode and prefill run slower (docs/quantization.md, "Activations on two rows").

XNNPACK keeps blockwise scales in bf16, so :class:`BlockInt4Linear` rounds them to bf16 when
built: the eager module computes what the program computes, and the parity check compares
like with like. :func:`bf16_scale_error` measures what that rounding costs.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmcore.errors import LlmcoreError
from llmcore.modules import static_shape
from llmcore.progress import heap_for_temporaries
from llmcore.stored import id_runs, q4_k_block_values

# Importing this module registers the quantized_decomposed ops with torch.
import torch.ao.quantization.fx._decomposed  # noqa: F401

_qd = torch.ops.quantized_decomposed


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """int8 per token, asymmetric, chosen at run time (XNNPACK's qd8); returns the
    dequantized values, which is what the GEMM sees."""
    scale, zero = _qd.choose_qparams_per_token_asymmetric(x, torch.int8)
    q = _qd.quantize_per_token(x, scale, zero, -128, 127, torch.int8)
    return _qd.dequantize_per_token(q, scale, zero, -128, 127, torch.int8, torch.float32)


# A token's values above this fraction of its largest magnitude go to the second row.
# 1/8 was the best of 1/4, 1/8 and 1/16 by mean KL on SmolLM2's Q4_1 GGUF
# (docs/quantization.md, "Activations on two rows").
OUTLIER_FRACTION = 0.125

# The last result of each computation layers share per input (split_outliers, block_means),
# with a weak reference to that input: q, k and v (and gate and up) read the same tensor one
# after another, and the program computes it once for all of them (in eager runs and in the
# traced graph alike).
_last_results: dict[str, tuple] = {}


def _once_per_input(kind: str, x: torch.Tensor, key, compute):
    """``compute()``, or its result for the same ``x`` and ``key`` if it was the last ``kind``."""
    source, source_key, result = _last_results.get(kind, (lambda: None, None, None))
    if source() is x and source_key == key:
        return result
    result = compute()
    _last_results[kind] = (weakref.ref(x), key, result)
    return result


def split_outliers(x: torch.Tensor) -> torch.Tensor:
    """``[tokens, 2, 1, K]``: each token of ``x`` clamped to +-``OUTLIER_FRACTION`` of its
    largest magnitude, and the remainder ``x - clamped`` (zero except at the outliers). The two
    rows add up to the token exactly; quantized each with its own per-token scale, the first keeps
    8x the resolution a single scale would give it, and the second is exact at its zeros.

    The layout is XNNPACK's: it delegates a max over the last dim of a 4-D tensor (a pooling), a
    ``cat`` along a dim of static size, ``maximum``/``minimum``; it refuses slices and
    unsqueezes of a tensor whose token count is dynamic."""

    def split() -> torch.Tensor:
        x4 = x.reshape(-1, 1, 1, x.shape[-1])
        bound = torch.max(x4.abs(), dim=3, keepdim=True)[0] * OUTLIER_FRACTION
        clamped = torch.minimum(torch.maximum(x4, -bound), bound)
        return torch.cat([clamped, x4 - clamped], dim=1)

    return _once_per_input("split", x, None, split)


def rounded_per_block(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``x`` rounded to int8 per block of ``block`` features, symmetric, as llmcore-kernels rounds
    the activations of its int4 GEMM (and llama.cpp those of its Q4 dot products): ``q =
    round(x * (1 / s))``, ``s = max |x| / 127`` over the block in float32, ties to even; returns
    ``q * s``. A token's few large channels then coarsen only their own blocks: on SmolLM2's
    Q4_1 GGUF the mean KL from the file's floats 0.0027 against 0.017 per token
    (docs/quantization.md, "Activations rounded per block")."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    scale = blocks.abs().amax(-1, keepdim=True) / 127.0
    inverse = torch.where(scale == 0, 0.0, 1.0 / torch.where(scale == 0, 1.0, scale))
    q = torch.round(blocks * inverse).clamp_(-127, 127)
    return (q * scale).reshape(x.shape)


# Whether eager int4 layers round their activations per block (llmcore-kernels' arithmetic,
# inside :func:`kernels_rounding`) rather than per token (XNNPACK's, the default).
_per_block = contextvars.ContextVar("llmcore_int4_activations_per_block", default=False)


@contextlib.contextmanager
def kernels_rounding() -> Iterator[None]:
    """Inside, an eager :class:`BlockInt4Linear` rounds its activations per block of 32 as
    llmcore-kernels does (:func:`rounded_per_block`), for a check that compares the kernels with
    the module they replace; outside, per token, as XNNPACK runs the module's graph."""
    token = _per_block.set(True)
    try:
        yield
    finally:
        _per_block.reset(token)


def int8_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], outlier_split: bool,
              rounding: Callable[[torch.Tensor], torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with int8 activations per token: one row per token, or the two
    rows of :func:`split_outliers`, added after the GEMM (as twice their mean over a
    ``[tokens, N, 1, 2]`` view: XNNPACK's global average pooling; it has no sum). ``rounding``:
    another rounding of ``x`` in place of per token (:func:`rounded_per_block`; no split)."""
    if rounding is not None:
        return F.linear(rounding(x), weight, bias)
    if not outlier_split:
        return F.linear(quantize_activations(x), weight, bias)
    both = F.linear(quantize_activations(split_outliers(x)), weight)  # [tokens, 2, 1, N]
    y = both.permute(0, 3, 2, 1).mean((2, 3), keepdim=True) * 2.0
    y = y.view(static_shape(x)[:-1] + [weight.shape[0]])
    return y if bias is None else y + bias


# fp32 weight bytes an eager quantized linear decodes at once (gemm_by_rows): the kernels' swap
# check runs each layer eagerly on top of an export's peak, and 32 MiB slices held Llama-3.2-1B's
# take stage 20-45 MiB higher than these (docs/performance.md, "Cost by model size")
_EAGER_WEIGHT_BYTES = 8 * 2**20


def gemm_by_rows(x: torch.Tensor, layer: nn.Module, bias: Optional[torch.Tensor], outlier_split: bool,
                 values: Optional[Callable[[slice], torch.Tensor]] = None,
                 rounding: Callable[[torch.Tensor], torch.Tensor] = None) -> torch.Tensor:
    """:func:`int8_gemm` of a quantized ``layer`` computed eagerly (the parity reference, a
    backend's check of what it took), its fp32 weight decoded a slice of output rows at a
    time (``values(rows)``, by default ``layer.weight_values``): whole, one of Llama-3.1-8B's
    MLP matrices is 224 MiB, on top of a large export's peak. Activations are rounded per
    token, so each slice's outputs are the whole GEMM's."""
    values = values or layer.weight_values
    if rounding is not None:  # once for every slice
        x, rounding = rounding(x), (lambda rounded: rounded)
    step = max(1, _EAGER_WEIGHT_BYTES // (4 * layer.in_features))
    parts = []
    for start in range(0, layer.out_features, step):
        rows = slice(start, start + step)
        parts.append(int8_gemm(x, values(rows), None if bias is None else bias[rows], outlier_split, rounding))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def rounded_per_token(x: torch.Tensor) -> torch.Tensor:
    """:func:`quantize_activations`' values, computed in a few fp32 operations.

    For searches that round the same small activations hundreds of times: the decomposed
    operators quantize in float64, several times slower than this (docs/quantization.md,
    "Side by side with llama.cpp, one run"). The two differ only where ``x / scale`` lies on
    a rounding tie in one precision and not the other (about one value in a million, by
    one int8 step), which does not move a search's choice; ``test_qlinear`` holds them to
    that."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 255.0).clamp(min=torch.finfo(torch.float32).eps)
    low, high = lo / scale, hi / scale
    # the zero point of the end whose rounding error is smaller (XNNPACK's choice)
    zero = torch.where(low + high > 1.0, -128.0 - low, 127.0 - high).clamp(-128, 127).round()
    inverse = scale.double().reciprocal().float()  # the operator takes 1/scale in float64
    return torch.round(x * inverse + zero).clamp_(-128, 127).sub_(zero).mul_(scale)


def gemm_input(x: torch.Tensor, outlier_split: bool) -> torch.Tensor:
    """``x`` as :func:`int8_gemm`'s GEMM sees it after rounding (one row per token, or the
    sum of the two rounded rows of :func:`split_outliers`), for searches that score roundings."""
    if not outlier_split:
        return rounded_per_token(x)
    return rounded_per_token(split_outliers(x)).sum(1).reshape(x.shape)


def block_means(x: torch.Tensor, block: int) -> torch.Tensor:
    """``[..., in/block]``: the mean of ``x`` over each block of ``block`` features.

    Written as XNNPACK's global average pooling (a mean over the last two dims of a 4-D view,
    kept), one small operator, where a GEMM with a 0/1 matrix was one of the delegate's
    largest fixed costs per token. Layers reading the same input with the same block (q, k, v;
    gate, up) share one result, like :func:`split_outliers`."""

    def means() -> torch.Tensor:
        blocks = x.shape[-1] // block
        pooled = x.reshape(-1, blocks, 1, block).mean((2, 3), keepdim=True)
        return pooled.view(static_shape(x)[:-1] + [blocks])

    return _once_per_input("means", x, block, means)


class BlockInt4Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W[o, i] = scales[o, i//block] * q[o, i] (+ offsets[o, i//block])``.

    ``q``: int8 ``[out, in]`` in [-8, 7]; ``scales``: ``[out, in/block]`` (rounded to bf16
    here); ``offsets``: ``[out, in/block]`` or None (rounded here so that ``offsets * block``
    is a float16: :func:`float16_offsets`). The int4 part runs on int8 activations; the
    offset term on the fp32 activations (it is a sum, not a product with 4-bit values, and
    costs 1/block of the GEMM).

    ``nibbles``: hold the integers two to a byte (``q_nibbles``, ``q`` None) until a backend
    that runs int4 itself takes the layer: half their memory while a large model waits
    between the recipe and that backend (llmcore-kernels asks for it). :meth:`integers` reads
    them either way; :meth:`unpack_` restores ``q`` for XNNPACK, which lowers an int8 ``q``.
    XNNPACK takes positive scales only (:func:`_positive_scales`: a negative one becomes an
    offset); held as nibbles, the scales stay as given, of either sign and in bfloat16, until
    :meth:`unpack_`: the kernels take them so, and a Q4_0 model (a negative scale in about
    half its blocks) then holds 18 bytes a block, as its file, not 25 (offsets, float32
    scales, zero points: 1.5 GB more in Llama-3.1-8B's export).

    ``q4_k_headers``: for integers a GGUF stores as Q4_K, its super-blocks' 16-byte headers as
    the file holds them (uint8 ``[out, in/256, 16]``; ``scales`` and ``offsets`` must be the
    values ``llmcore.stored.q4_k_block_values`` gives for them), kept with ``nibbles`` for
    llmcore-kernels, which computes those exact values from the file's 4.5 bits a weight. The
    layer then holds the headers in place of its scales and offsets (``scales`` and
    ``offset_weight`` are None: 2 bytes a block where a bf16 scale and a float16 offset took 4,
    so that a Q4_K_M export holds less than before, not more) and computes with their exact
    values (the eager model the export checks the program against). XNNPACK takes bf16 scales
    and float16 offsets: ``unpack_`` rounds the headers' values so (:meth:`int4_block_form`) and
    drops them.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                 bias: Optional[torch.Tensor] = None, outlier_split: bool = False, nibbles: bool = False,
                 q4_k_headers: Optional[torch.Tensor] = None):
        super().__init__()
        self.outlier_split = outlier_split
        out_features, in_features = q.shape
        if scales.dim() != 2 or scales.shape[0] != out_features or in_features % scales.shape[1]:
            raise ValueError(f"scales {tuple(scales.shape)} do not divide a [{out_features}, {in_features}] weight")
        if q.dtype != torch.int8 or int(q.min()) < -8 or int(q.max()) > 7:
            raise ValueError("int4 weights must be int8 values in [-8, 7]")
        self.in_features, self.out_features = in_features, out_features
        self.block = in_features // scales.shape[1]
        scales = scales.to(torch.bfloat16).float()
        offsets = float16_offsets(offsets, self.block)
        if not nibbles:
            q, scales, offsets = _positive_scales(q, scales, offsets, self.block)
        if nibbles and in_features % 2:
            raise ValueError(f"int4 weights held two to a byte need an even width, not {in_features}")
        if q4_k_headers is not None and (not nibbles or self.block != 32 or q4_k_headers.dtype != torch.uint8
                                         or tuple(q4_k_headers.shape) != (out_features, in_features // 256, 16)
                                         or in_features % 256):
            raise ValueError(f"Q4_K headers for a [{out_features}, {in_features}] int4 weight held two to a byte "
                             f"must be uint8 [{out_features}, {in_features // 256}, 16], got "
                             f"{tuple(q4_k_headers.shape)} {q4_k_headers.dtype}")
        self.register_buffer("q4_k_headers", q4_k_headers)
        if q4_k_headers is not None:  # the headers hold the scales and offsets
            scales, offsets = None, None
        self.register_buffer("q", None if nibbles else q.contiguous())
        self.register_buffer("q_nibbles", pack_nibbles(q) if nibbles else None)
        self.register_buffer("scales", None if scales is None else
                             (scales.to(torch.bfloat16) if nibbles else scales).contiguous())
        # the zero points XNNPACK's pattern names (all 0: the integers are symmetric), made with q
        self.register_buffer("zeros", None if nibbles else torch.zeros(scales.shape, dtype=torch.int8))
        self.offset_weight = _offset_weight(offsets, self.block)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @property
    def has_offsets(self) -> bool:
        """Whether the weight has per-block offsets (``offset_weight``, or a Q4_K header's minima)."""
        return self.offset_weight is not None or self.q4_k_headers is not None

    def int4_block_form(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(scales, offset_weight or None)`` as int4 blocks hold them (bf16 scales, float16
        offset weights: XNNPACK's form, and the kernels' int4 blocks): the layer's own, or its
        Q4_K headers' values rounded so."""
        if self.q4_k_headers is None:
            return self.scales, self.offset_weight
        scales, offsets = q4_k_block_values(self.q4_k_headers)
        rows = self.out_features
        offsets = float16_offsets(offsets.reshape(rows, -1), self.block)
        return scales.reshape(rows, -1).to(torch.bfloat16), _offset_weight(offsets, self.block)

    def weight_values(self, rows: slice = slice(None)) -> torch.Tensor:
        """The fp32 weight this layer computes with (for measuring it); ``rows`` of it."""
        w = self._int4_values(rows)
        offset_weight = self._offset_weight_used(rows)
        if offset_weight is not None:
            w = w.view(w.shape[0], -1, self.block).add_((offset_weight / self.block).unsqueeze(-1))
        return w.reshape(-1, self.in_features)

    def _scales_used(self, rows: slice = slice(None)) -> torch.Tensor:
        """The scales this layer computes with: its Q4_K headers' exact ones while it holds
        them, else ``scales`` (bf16 values)."""
        if self.q4_k_headers is None:
            return self.scales[rows]
        scales, _ = q4_k_block_values(self.q4_k_headers[rows])
        return scales.reshape(scales.shape[0], -1)

    def _offset_weight_used(self, rows: Optional[slice] = None) -> Optional[torch.Tensor]:
        """The offset weight (offsets times the block) this layer computes with (``rows`` of it,
        or the parameter itself: what XNNPACK's partitioner sees in an export): its Q4_K
        headers' exact offsets while it holds them, else ``offset_weight``."""
        if self.q4_k_headers is None:
            return self.offset_weight if self.offset_weight is None or rows is None else self.offset_weight[rows]
        _, offsets = q4_k_block_values(self.q4_k_headers if rows is None else self.q4_k_headers[rows])
        return offsets.reshape(offsets.shape[0], -1) * self.block

    def integers(self, rows: slice = slice(None)) -> torch.Tensor:
        """``q[rows]``: int8 in [-8, 7], whether held as bytes or as nibbles."""
        return self.q[rows] if self.q is not None else unpack_nibbles(self.q_nibbles[rows])

    def unpack_(self) -> "BlockInt4Linear":
        """Hold the integers as int8 again, with positive scales (what XNNPACK's lowering
        reads); in place. The same weights."""
        if self.q is None:
            scales, offset_weight = self.int4_block_form()
            offsets = None if offset_weight is None else offset_weight.detach() / self.block
            q, scales, offsets = _positive_scales(self.integers(), scales.float(), offsets, self.block)
            self.q, self.q_nibbles, self.scales = q.contiguous(), None, scales.contiguous()
            self.zeros = torch.zeros(scales.shape, dtype=torch.int8)
            self.offset_weight = _offset_weight(offsets, self.block)
            self.q4_k_headers = None  # XNNPACK computes the bf16 scales and float16 offsets
        return self

    def _int4_values(self, rows: slice = slice(None)) -> torch.Tensor:
        """``scales * q``: the int4 part, what ``dequantize_per_channel_group`` gives."""
        q = self.integers(rows)
        w = q.float().view(q.shape[0], -1, self.block).mul_(self._scales_used(rows).unsqueeze(-1))
        return w.view(q.shape[0], self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():  # the pattern XNNPACK's partitioner lowers
            if self.q is None:
                raise ValueError("an int4 layer held as nibbles reached export: the backend that asked for "
                                 "nibbles must take it or unpack_() it")
            w = _qd.dequantize_per_channel_group(
                self.q, self.scales, self.zeros, -8, 7, torch.int8, self.block, torch.float32
            )
            y = int8_gemm(x, w, self.bias, self.outlier_split)
        else:  # the same values, without the decomposed op's int temporaries (eager reference)
            per_block = _per_block.get() and not self.outlier_split  # (kernels_rounding)
            y = gemm_by_rows(x, self, self.bias, self.outlier_split, values=self._int4_values,
                             rounding=rounded_per_block if per_block else None)
        offset_weight = self._offset_weight_used()
        if offset_weight is not None:
            # offsets * sum(x over the block) = (offsets * block) * mean(x over the block)
            y = y + F.linear(block_means(x, self.block), offset_weight)
        return y

    def extra_repr(self) -> str:
        kind = "int4 + per-block offsets" if self.has_offsets else "int4"
        if self.q4_k_headers is not None:
            kind += " (Q4_K headers kept)"
        split = ", outlier split" if self.outlier_split else ""
        return f"{self.in_features}, {self.out_features}, {kind}, block={self.block}{split}"


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int8 ``[rows, cols]`` in [-8, 7] -> uint8 ``[rows, cols / 2]``: ``q + 8`` of each even
    column in the low nibble, of the odd column after it in the high one."""
    u = (q + 8).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`."""
    q = torch.empty(*packed.shape[:-1], 2 * packed.shape[-1], dtype=torch.uint8)
    q[..., 0::2] = packed & 0x0F
    q[..., 1::2] = packed >> 4
    return q.view(torch.int8).sub_(8)


def float16_offsets(offsets: Optional[torch.Tensor], block: int) -> Optional[torch.Tensor]:
    """``offsets`` (fp32) rounded so that ``offsets * block``, the offset weight, is a float16.

    llmcore-kernels stores a layer's offset weight in float16, 2 bytes a block of 32 beside
    its 16 bytes of integers and 2 of scale, not 4 (a Q4_1 program's int4 layers read 9%
    fewer bytes a token: 20 a block, not 22); rounded here, every backend and the eager
    model compute with the same weights, and what the export measures is what runs. The
    rounding moves an offset by at most 2^-11 of itself (a Q4_1 block's ``m + 8d`` is its
    midpoint, small beside ``d``), far below the bf16 rounding of the scales. Offsets beyond
    float16's range (65504 / block) are refused: no real weight is near it."""
    if offsets is None:
        return None
    weight = offsets.float() * block
    largest = float(weight.abs().max()) if weight.numel() else 0.0
    if not largest <= torch.finfo(torch.float16).max:
        raise ValueError(f"int4 block offsets reach {largest / block:.6g}: beyond what the float16 offset weight "
                         f"holds (|offset| * {block} <= {torch.finfo(torch.float16).max:.0f})")
    return weight.to(torch.float16).float().div_(block)


def _offset_weight(offsets: Optional[torch.Tensor], block: int) -> Optional[nn.Parameter]:
    """:class:`BlockInt4Linear`'s ``offset_weight``: ``offsets * block``, which multiplies the
    activations' block means (see its forward); None without offsets."""
    return None if offsets is None else nn.Parameter((offsets.float() * block).contiguous(), requires_grad=False)


def _positive_scales(q: torch.Tensor, scales: torch.Tensor, offsets: Optional[torch.Tensor], block: int):
    """The same weights with every scale positive and normal, as XNNPACK requires.

    A GGUF's Q4_0 writer picks ``d = max / -8``, negative for about half the blocks. Such a
    block is ``d*q = |d|*(-q-1) + |d|``: the integers stay in [-8, 7] and ``|d|`` joins the
    block's offset. A zero scale (all-equal block) becomes 1 with integers 0. Exact either way.
    """
    negative = scales < 0
    zero = scales == 0
    if not bool(negative.any() or zero.any()):
        return q, scales, offsets
    blocks = q.view(q.shape[0], -1, block)  # masks broadcast over each block's values
    q = torch.where(negative.unsqueeze(-1), torch.bitwise_not(blocks), blocks)  # ~q == -q - 1, in [-8, 7]
    q = torch.where(zero.unsqueeze(-1), torch.zeros((), dtype=torch.int8), q).view(blocks.shape[0], -1)
    shift = torch.where(negative, -scales, torch.zeros_like(scales))
    offsets = shift if offsets is None else offsets.float() + shift
    scales = torch.where(negative, -scales, torch.where(zero, torch.ones_like(scales), scales))
    return q, scales, offsets


class ChannelInt8Linear(nn.Module):
    """``y = x @ (scales[:, None] * q).T (+ bias)``: int8 weights, one scale per output channel."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 outlier_split: bool = False):
        super().__init__()
        self.outlier_split = outlier_split
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.float().reshape(-1).contiguous())
        self.register_buffer("zeros", torch.zeros(self.out_features, dtype=torch.int64))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def weight_values(self, rows: slice = slice(None)) -> torch.Tensor:
        return self.q[rows].float().mul_(self.scales[rows].unsqueeze(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():  # the pattern XNNPACK's partitioner lowers
            w = _qd.dequantize_per_channel(
                self.q, self.scales, self.zeros, 0, -127, 127, torch.int8, out_dtype=torch.float32
            )
            return int8_gemm(x, w, self.bias, self.outlier_split)
        # Eager (the parity reference): the same values, a slice of output rows at a time.
        # The decomposed op's int64 temporary of SmolLM2's 49152 x 576 output layer, and even
        # one fp32 copy of it, would add to the export's peak (docs/performance.md,
        # "Measurements behind the code").
        return gemm_by_rows(x, self, self.bias, self.outlier_split)

    def extra_repr(self) -> str:
        split = ", outlier split" if self.outlier_split else ""
        return f"{self.in_features}, {self.out_features}, int8 per channel{split}"


def float16_values(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is a float16, so that float16 holds it exactly (a GGUF's
    block scales, a layer's offset weights once :func:`float16_offsets` rounded them)."""
    t = t.detach().float()
    return torch.equal(t.half().float(), t)


def float16_if_exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float16 where every value is one (:func:`float16_values`), else as float32:
    the runtime's quantized embedding kernels widen either exactly."""
    return t.half() if float16_values(t) else t.float()


def int8_block_values(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``scales[..., i // block] * q[..., i]`` in fp32, the block read off the shapes: the
    values of int8 rows with a scale per block of columns (a Q8_0 table, its lookups' rows)."""
    return (q.float().unflatten(-1, (scales.shape[-1], -1)) * scales.float().unsqueeze(-1)).flatten(-2)


def refuse_untaken(what: str, option: str, otherwise: str) -> None:
    """Stop an export in which a module only llmcore-kernels computes reached ``torch.export``
    untaken (the ``gguf`` recipe's ``option`` kept a form XNNPACK has no kernel for), in one
    line naming the fix, rather than leave ExecuTorch's portable operators a full fp32 copy
    of the weight a call, or no kernel at all."""
    raise LlmcoreError(
        f"gguf: {what} ({option}), which only llmcore-kernels computes, and no backend took it.",
        fix=f"install llmcore-kernels and list it first (--plugins kernels,xnnpack), or pass "
            f"--quantize-option {option}=false ({otherwise}).",
    )


class BlockInt8Linear(nn.Module):
    """``y = x @ W.T (+ bias)``, ``W[o, i] = scales[o, i // 32] * q[o, i]``: a GGUF's Q8_0 as
    the file holds it (int8, one float16 scale a block of 32 inputs), for an output layer whose table
    the embedding shares (the ``gguf`` recipe with ``tied_table``): the program then holds the
    table once, its integers unchanged. llmcore-kernels computes it (``llmcore::int4_linear``
    on int8 blocks); XNNPACK's int8 GEMM takes one scale a channel, so a layer of these that
    reaches ``torch.export`` untaken is refused by name rather than left to ExecuTorch's
    portable operators (a full fp32 copy of the table a call). Its activations are rounded as
    the kernels round them for it, per block of 32 (:func:`rounded_per_block`), always: nothing
    else computes this layer."""

    block = 32
    outlier_split = False

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        if self.in_features % self.block or scales.shape != (self.out_features, self.in_features // self.block):
            raise ValueError(f"int8 blocks of {self.block}: a {tuple(q.shape)} weight needs "
                             f"[{self.out_features}, {self.in_features // self.block}] scales, got {tuple(scales.shape)}")
        if not float16_values(scales):
            raise ValueError("int8 blocks' scales must be float16 values (Q8_0's)")
        # the tensors as given when they already are int8 and float16 (a tied table's, shared
        # with its lookups: one constant in the program)
        self.register_buffer("q", q.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.half().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def weight_values(self, rows: slice = slice(None)) -> torch.Tensor:
        return int8_block_values(self.q[rows], self.scales[rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            refuse_untaken(f"a {self.out_features} x {self.in_features} linear keeps its table's Q8_0 blocks",
                           "tied_table", "the output layer then rounds the table to int8 per channel")
        return gemm_by_rows(x, self, self.bias, False, rounding=rounded_per_block)  # the eager reference

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, int8 per block of {self.block}"


Q6_K_VALUES, Q6_K_BYTES = 256, 210
"""A GGUF's Q6_K super-block: its values and its bytes (ql, qh, 16 int8 scales, a float16 d),
which a :class:`StoredBlocksLinear` of that format holds as they are."""


class StoredBlocksLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W`` kept as the checkpoint stores it: ``blocks``, its
    bytes in the file's ``format`` (uint8 ``[out, blocks a row, bytes a block]``), for an output layer stored
    as Q6_K (a Q4_K_M GGUF's: the ``gguf`` recipe with ``q6_k_output``). The program then
    holds the file's 6.56 bits a weight and its exact values, where int8 per channel took 8
    bits and rounded every weight again. Only llmcore-kernels computes it (``llmcore::int4_linear``
    on Q6_K super-blocks); a layer of these that reaches ``torch.export`` untaken is refused
    by name. ``values(rows)`` gives those rows' fp32 weights as the loader decodes them: the
    eager reference (activations rounded per token, as the kernel's)."""

    outlier_split = False

    def __init__(self, format: str, blocks: torch.Tensor, values: Callable[[slice], torch.Tensor],
                 shape: tuple[int, int], bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.format = format
        self.out_features, self.in_features = shape
        if blocks.dim() != 3 or blocks.shape[0] != self.out_features or blocks.dtype != torch.uint8:
            raise ValueError(f"{format}: a {shape} weight's stored bytes must be uint8 [{self.out_features}, "
                             f"blocks a row, bytes a block], got {blocks.dtype} {tuple(blocks.shape)}")
        self.register_buffer("blocks", blocks.contiguous())
        self.values = values
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def weight_values(self, rows: slice = slice(None)) -> torch.Tensor:
        return self.values(rows).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            refuse_untaken(f"a {self.out_features} x {self.in_features} output layer keeps the file's {self.format}",
                           "q6_k_output", "the layer then rounds it to int8 per channel")
        return gemm_by_rows(x, self, self.bias, False)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.format} as stored"


class StoredBlocksEmbedding(nn.Module):
    """The lookups of a token table tied to a :class:`StoredBlocksLinear`: its ``blocks``
    tensor itself (one table in the program, as in the file), whose rows llmcore-kernels'
    lookup (``llmcore::q6_k_embedding``) decodes in this module's place before export."""

    def __init__(self, output: StoredBlocksLinear, padding_idx: Optional[int] = None):
        super().__init__()
        self.format = output.format
        self.num_embeddings, self.embedding_dim = output.out_features, output.in_features
        self.padding_idx = padding_idx
        self.register_buffer("blocks", output.blocks)  # the tensor itself, not a copy
        self.values = output.values

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            refuse_untaken(f"a {self.num_embeddings} x {self.embedding_dim} token table keeps the file's {self.format}",
                           "q6_k_output", "the table then becomes the output layer's int8 rows")
        wanted, where = torch.unique(indices.reshape(-1), return_inverse=True)
        rows = torch.cat([self.values(run).float() for run in id_runs(wanted)])  # in wanted's order
        return rows[where].reshape(*indices.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, the output layer's {self.format} (tied: one table)"


# ---- choosing integers for float weights ------------------------------------------------------


def int4_blocks(weight: torch.Tensor, block: int, hqq: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 per block of ``block`` input features: ``(q [out, in], scales [out, in/block])``.

    torchao chooses the integers (min/max, or HQQ's scale search), as the ``8da4w`` recipe
    always has; only the module that carries them is ours.
    """
    from torchao.quantization.quant_primitives import (
        MappingType,
        _choose_qparams_and_quantize_scale_only_hqq,
        choose_qparams_affine,
        quantize_affine,
    )

    w = weight.detach().float()
    block_size = (1, block)
    if hqq:
        q, scale = _choose_qparams_and_quantize_scale_only_hqq(w, list(block_size), -8, 7)
    else:
        scale, zero = choose_qparams_affine(
            w, MappingType.SYMMETRIC, block_size, target_dtype=torch.int8, quant_min=-8, quant_max=7,
            zero_point_dtype=torch.int8, keepdim=True,
        )
        q = quantize_affine(w, block_size, scale, zero, output_dtype=torch.int8, quant_min=-8, quant_max=7)
    return q.to(torch.int8), scale.float().reshape(w.shape[0], w.shape[1] // block)


# Scales int4_blocks_activation_aware tries per block, as fractions of min/max's (amax / 7.5).
# On SmolLM2 26 steps from 0.7 to 1.2 beat HQQ's scale-only search by mean KL from fp32
# (docs/quantization.md, "Activation-aware scales by default").
_SCALE_FRACTIONS = torch.linspace(0.7, 1.2, 26).tolist()
# the same as multipliers of amax, in float32: torch multiplies a float32 tensor by a Python
# float in float32, so amax * (fraction / 7.5) is amax times these, bit for bit
_SCALE_MULTIPLIERS = torch.tensor([fraction / 7.5 for fraction in _SCALE_FRACTIONS], dtype=torch.float32)


def int4_blocks_activation_aware(
    weight: torch.Tensor, block: int, input_energy: torch.Tensor, error: Optional["ErrorSum"] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 per block, ``(q [out, in], scales [out, in/block])``, each block's scale
    the one that minimises the output error its rounding causes rather than the weight error:
    ``sum_j E[x_j^2] (w_j - d*q_j)^2`` over the block, ``E[x_j^2]`` being ``input_energy``,
    the mean square of input feature ``j`` on calibration text.

    Why: a layer's error is ``x . (w - w_q)``, and in an LLM a few input features carry most
    of the activation energy (the norm weights and the residual stream's outlier channels);
    a scale fitted to the weights alone spends precision evenly. This is the diagonal of
    GPTQ's objective with no error feedback: on SmolLM2, GPTQ's full column-by-column
    feedback calibrated on a few hundred tokens of unrelated text made the program worse
    than no calibration, while the diagonal alone needs only a few hundred tokens
    (docs/quantization.md, "Activation-aware scales by default").

    The candidates are rounded to bf16 (XNNPACK's scale type) before they are scored, so the
    chosen scale is the program's. A 1% floor on the energies keeps channels the text never
    excited from being rounded freely. With ``error``, the weight error of the result is added
    to it while each slice of rows is in hand (no second pass over the weight to measure it).
    """
    w = weight.detach().float()
    out_features, in_features = w.shape
    blocks = in_features // block
    energy = _energy_weights(input_energy).reshape(blocks, block)
    native = native_op("block_round_least_error") if block % 8 == 0 else None
    if native is not None:  # the loop below in one native pass (why: native_op)
        q, scales, sums = native(w, energy, _SCALE_MULTIPLIERS, block, -8, 7)
        if error is not None:
            error.add_sums(float(sums[0]), float(sums[1]))
        return q, scales
    q = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(out_features, blocks)
    with heap_for_temporaries(give_back=False):
        for start in range(0, out_features, _SEARCH_ROWS):
            wb = w[start:start + _SEARCH_ROWS].reshape(-1, blocks, block)
            amax = wb.abs().amax(-1).clamp(min=1e-12)
            # [rows, groups, 26]: one product per candidate, as amax * (fraction / 7.5) each was
            candidates = (amax.unsqueeze(-1) * _SCALE_MULTIPLIERS).to(torch.bfloat16).float()
            best_d = _least_output_error(wb, energy, candidates.unbind(-1), -8, 7)
            scaled = wb * best_d.reciprocal().unsqueeze(-1)
            rows = slice(start, start + wb.shape[0])
            rounded = torch.round(scaled).clamp_(-8, 7)
            q[rows] = rounded.to(torch.int8).reshape(-1, in_features)
            scales[rows] = best_d
            if error is not None:
                error.add(rounded.mul_(best_d.unsqueeze(-1)), wb)
    return q, scales


def int4_rounded(weight: torch.Tensor, block: int) -> torch.Tensor:
    """``weight`` on min/max's symmetric int4 grid per block, bf16 scales: the cheap rounding
    the channel-scale search scores (its choices hold for the searched scales as well)."""
    w = weight.float().reshape(weight.shape[0], -1, block)
    d = (w.abs().amax(-1, keepdim=True) / 7.5).clamp(min=1e-12).to(torch.bfloat16).float()
    return (torch.round(w / d).clamp_(-8, 7) * d).reshape(weight.shape)


def _energy_weights(input_energy: torch.Tensor) -> torch.Tensor:
    """Per input feature, the weight of its rounding error in the activation-aware searches:
    its mean square on the calibration text, plus a 1% floor (of the mean) so that features
    the text never excited are not rounded freely."""
    energy = input_energy.detach().float().clamp(min=0)
    return energy + 0.01 * energy.mean() + torch.finfo(torch.float32).tiny


def _least_output_error(wb: torch.Tensor, energy: torch.Tensor, candidates, qmin: int, qmax: int,
                        total: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """For the groups of weights ``wb`` ``[rows, groups, size]``, each group's scale among
    ``candidates`` (tensors ``[rows, groups]``) with the least ``sum_j energy_j (w_j - d*q_j)^2``,
    ``q`` being ``w/d`` rounded into ``[qmin, qmax]`` (``energy``: ``[groups, size]``); the
    first of equal errors. ``total`` sums over the last dimension: torch's ``sum`` when None
    (the tests pass the native search's order, to check it against this one)."""
    scaled, rounded = torch.empty_like(wb), torch.empty_like(wb)  # reused: no allocation per candidate
    best_err = best_d = None
    for d in candidates:
        torch.mul(wb, d.reciprocal().unsqueeze(-1), out=scaled)
        torch.round(scaled, out=rounded).clamp_(qmin, qmax)
        weighted = scaled.sub_(rounded).square_().mul_(energy)
        err = (weighted.sum(-1) if total is None else total(weighted)) * d.square()
        if best_err is None:
            best_err, best_d = err, d
        else:
            better = err < best_err
            best_err, best_d = torch.where(better, err, best_err), torch.where(better, d, best_d)
    return best_d


_NATIVE_OPS: dict = {}


def native_op(name: str) -> Optional[Callable[..., Any]]:
    """``torch.ops.llmcore.<name>`` where llmcore-kernels is installed and its library built
    (with that operator), else None: the recipe's rounding then runs in torch. Looked up once
    per process and name.

    Why native: ``llmcore::block_round_least_error`` does :func:`int4_blocks_activation_aware`'s
    work in one pass, a block's weights and energies loaded once and every candidate scored
    in registers. In torch each candidate was seven passes over the weight's float
    temporaries, 26 candidates a block: 16 s of a 1B model's 39 s quantize stage; with only
    the search native, the steps around it (the largest values, the candidates, the rounding,
    the error) were still 5 of its 12 s of int4 rounding (docs/performance.md, "Measurements
    behind the code"). Why in a plugin this one does not depend on: the rounding is this
    recipe's and must run wherever it does, but native code is what llmcore-kernels builds.

    The native search scores each candidate with the torch search's float operations but
    adds a block's terms in an order of its own (torch picks its order by CPU), so the two
    choose the same scale except where two candidates' errors tie to the last bit: 1 block in
    524,288 of a random 8192 x 2048 weight, as torch's own builds differ from one another
    (its portable build against its AVX2 and AVX-512 ones: 2 blocks of that weight)."""
    if name not in _NATIVE_OPS:
        found = None
        try:
            import llmcore_kernels.ops  # noqa: F401  (loads the library: registers the ops)

            found = getattr(torch.ops.llmcore, name).default
        except (ImportError, LlmcoreError, AttributeError):  # not installed, not built, built before the op
            found = None
        _NATIVE_OPS[name] = found
    return _NATIVE_OPS[name]


# Rounds of "round to the grid, refit the grid" in int4_blocks_affine (the first is min/max's
# grid). Past six rounds the weight error hardly moves (docs/quantization.md, "Asymmetric
# blocks").
_AFFINE_REFITS = 6


def int4_blocks_affine(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per block, ``w ~ d*u + m`` with ``u`` in [0, 15] (a GGUF's Q4_1 form), as
    :class:`BlockInt4Linear` takes it: ``(q = u - 8, scales = d, offsets = m + 8d)``.

    Each block starts from its min/max grid and then alternates rounding onto the grid with a
    least-squares refit of ``d`` and ``m`` to those integers, keeping the best grid seen (the
    error never grows). Weights that already sit on such a grid (a dequantized Q4_1 file) get
    their integers back exactly. ``d`` is rounded to bf16 (XNNPACK's scale type) before the
    last rounding and ``m`` refitted after it; :class:`BlockInt4Linear` rounds the offset
    ``m + 8d`` as it holds it (:func:`float16_offsets`), so the layer's weights, the ones
    measured, are the program's.
    Done a few thousand rows at a time: the float temporaries stay small.
    """
    out_features, in_features = weight.shape
    q = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(out_features, in_features // block)
    offsets = torch.empty(out_features, in_features // block)
    for start in range(0, out_features, _ROWS):
        w = weight[start:start + _ROWS].detach().float().reshape(-1, in_features // block, block)
        u, d, m = _affine_fit(w)
        rows = slice(start, start + w.shape[0])
        q[rows] = (u - 8).to(torch.int8).reshape(w.shape[0], in_features)
        scales[rows], offsets[rows] = d, m + 8 * d
    return q, scales, offsets


def _affine_fit(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(u [..., block], d [...], m [...])`` for blocks ``w [..., block]`` (see int4_blocks_affine)."""
    lo, hi = w.amin(-1), w.amax(-1)
    d = (hi - lo) / 15
    m = lo
    best_err = torch.full_like(d, float("inf"))
    best_d, best_m = d.clone(), m.clone()
    n = w.shape[-1]
    for _ in range(_AFFINE_REFITS):
        u = _affine_round(w, d, m)
        err = (w - (d.unsqueeze(-1) * u + m.unsqueeze(-1))).square().sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_d, best_m = torch.where(better, d, best_d), torch.where(better, m, best_m)
        # least squares for w ~ d*u + m over each block, given u
        su, sw = u.sum(-1), w.sum(-1)
        suu, suw = (u * u).sum(-1), (u * w).sum(-1)
        det = n * suu - su * su
        solvable = det > 0
        safe = torch.where(solvable, det, torch.ones_like(det))
        d = torch.where(solvable, (n * suw - su * sw) / safe, best_d)
        m = torch.where(solvable, (sw - d * su) / n, best_m)
        d = torch.where(d > 0, d, best_d)
    d = best_d.to(torch.bfloat16).float()
    m = best_m
    u = _affine_round(w, d, m)
    m = (w - d.unsqueeze(-1) * u).mean(-1)  # refit to the integers (the offset is rounded after)
    return u, d, m


def _affine_round(w: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The integers in [0, 15] nearest ``(w - m) / d`` (0 where ``d`` is 0: a constant block)."""
    safe = torch.where(d > 0, d, torch.ones_like(d)).unsqueeze(-1)
    u = torch.round((w - m.unsqueeze(-1)) / safe).clamp_(0, 15)
    return torch.where((d > 0).unsqueeze(-1), u, torch.zeros_like(u))


# Rows per step of the per-channel work on a large matrix (the 49152 x 576 output layer):
# float temporaries of a whole matrix would add several hundred MiB to the export's peak.
_ROWS = 4096
# Rows per step of the scale searches and the error sums, which make a dozen temporaries
# per step: 512 rows (~1-3 MiB each) ran as fast as 4096 (docs/performance.md,
# "Measurements behind the code") and keep fewer heap pages between
# ``heap_for_temporaries`` scopes. The results do not depend on the step: every row is
# computed alone (the same q and scales from 32 to 4096 rows).
_SEARCH_ROWS = 512


def int8_channels(weight: torch.Tensor, error: Optional["ErrorSum"] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel, in [-127, 127]: ``(q [out, in], scales [out])``.

    ``weight`` is read a slice of rows at a time (a tensor, or a weight still in its file:
    :func:`llmcore.stored.float_rows`); with ``error``, each slice's rounding error is added
    to it while the slice is in hand, so a weight in the file is decoded once, not again to
    measure it."""
    w = weight.detach()
    q = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(w.shape[0], dtype=torch.float32)
    step = _rows_per_step(w.shape[1])
    for start in range(0, w.shape[0], step):
        rows = w[start:start + step].float()
        s = (rows.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        part = torch.clamp(torch.round(rows / s.unsqueeze(1)), -127, 127)
        if error is not None:
            error.add(part * s.unsqueeze(1), rows)
        q[start:start + step] = part
        scales[start:start + step] = s
    return q, scales


# Elements per step of int8_channels: its half-dozen fp32 temporaries of 4096 rows of
# Llama-3.2-1B's 2048-wide output layer (33.5 MB each, on the heap that heap_for_temporaries
# keeps) put 262 MiB on the export's peak (1645 -> 1383 MiB with steps of 1M elements).
_STEP_ELEMENTS = 1 << 20


def _rows_per_step(width: int) -> int:
    return max(1, min(_ROWS, _STEP_ELEMENTS // max(width, 1)))


# Scales int8_channels_activation_aware tries per output channel, as fractions of min/max's
# (amax / 127).
_INT8_SCALE_FRACTIONS = torch.linspace(0.5, 1.0, 26).tolist()


def int8_channels_activation_aware(weight: torch.Tensor, input_energy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel, ``(q [out, in], scales [out])``, each channel's scale
    the one that minimises ``sum_j E[x_j^2] (w_j - d*q_j)^2`` (``input_energy``: the mean
    square of input feature ``j`` on calibration text), as :func:`int4_blocks_activation_aware`
    does for int4 blocks. A row of 576-8192 weights shares one scale, so min/max's scale is set
    by the row's largest weight and leaves the others few levels; clipping a few weights the
    input rarely excites can buy the rest a finer step."""
    w = weight.detach()
    out_features, in_features = w.shape
    energy = _energy_weights(input_energy).reshape(1, in_features)  # one group: the whole row
    q = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(out_features, dtype=torch.float32)
    with heap_for_temporaries(give_back=False):
        for start in range(0, out_features, _SEARCH_ROWS):
            rows = w[start:start + _SEARCH_ROWS].float()
            amax = rows.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
            candidates = (amax * (fraction / 127.0) for fraction in _INT8_SCALE_FRACTIONS)
            best_d = _least_output_error(rows.unsqueeze(1), energy, candidates, -127, 127).squeeze(1)
            q[start:start + _SEARCH_ROWS] = torch.round(rows / best_d.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
            scales[start:start + _SEARCH_ROWS] = best_d
    return q, scales


def relative_error(approx, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` (Frobenius): what a re-rounding costs a weight.
    ``approx`` is a tensor or a layer with ``weight_values(rows)``, read a few rows at a time.

    In fp32: torch sums pairwise, so the figure agrees with a float64 sum to ~1e-7
    relative, and it is much faster: the float64 sum was a visible part of an export
    (docs/performance.md, "Measurements behind the code")."""
    values = approx.weight_values if callable(getattr(approx, "weight_values", None)) else approx.__getitem__
    error = ErrorSum()
    with heap_for_temporaries(give_back=False):
        for start in range(0, exact.shape[0], _SEARCH_ROWS):
            error.add(values(slice(start, start + _SEARCH_ROWS)).float(), exact[start:start + _SEARCH_ROWS].detach().float())
    return error.relative


class ErrorSum:
    """:func:`relative_error`'s two sums, ``||approx - exact||^2`` and ``||exact||^2``, added
    a slice of rows at a time by code that has each slice in hand anyway."""

    def __init__(self) -> None:
        self.diff = self.norm = 0.0

    def add(self, approx: torch.Tensor, exact: torch.Tensor) -> None:
        self.add_sums(float((approx - exact).square().sum()), float(exact.square().sum()))

    def add_sums(self, diff: float, norm: float) -> None:
        """Sums a caller computed itself (``||approx - exact||^2``, ``||exact||^2``)."""
        self.diff += diff
        self.norm += norm

    @property
    def relative(self) -> float:
        return (self.diff ** 0.5) / max(self.norm ** 0.5, 1e-30)


def rescaled_error(q: torch.Tensor, scales: torch.Tensor, rescaled: torch.Tensor,
                   offsets: Optional[torch.Tensor] = None, kept_offsets: Optional[torch.Tensor] = None) -> float:
    """:func:`relative_error` of the block weights ``scales * q + offsets`` when their scales
    change to ``rescaled`` and their offsets to ``kept_offsets`` (what keeping a GGUF's
    integers does: bf16 scales, :func:`float16_offsets`): the difference is ``(rescaled -
    scales) * q + (kept_offsets - offsets)`` per block, so both norms follow from each block's
    sums of ``q`` and ``q^2``, without decoding either weight."""
    rows, cols = q.shape
    blocks = scales.shape[1]
    width = cols // blocks
    diff = norm = 0.0
    with heap_for_temporaries(give_back=False):
        for start in range(0, rows, _SEARCH_ROWS):
            part = q[start:start + _SEARCH_ROWS].view(-1, blocks, width).float()
            sums, squares = part.sum(-1), part.square().sum(-1)
            s = scales[start:start + _SEARCH_ROWS].float()
            change = rescaled[start:start + _SEARCH_ROWS].float() - s
            moved = change.square() * squares
            if kept_offsets is not None:  # sum over the block of (change q + shift)^2
                shift = kept_offsets[start:start + _SEARCH_ROWS].float() - offsets[start:start + _SEARCH_ROWS].float()
                moved += 2 * change * shift * sums + width * shift.square()
            diff += float(moved.sum())
            exact = s.square() * squares
            if offsets is not None:  # sum over the block of (s q + o)^2
                o = offsets[start:start + _SEARCH_ROWS].float()
                exact += 2 * s * o * sums + width * o.square()
            norm += float(exact.sum())
    return (diff ** 0.5) / max(norm ** 0.5, 1e-30)


def bf16_scale_error(scales: torch.Tensor, rounded: Optional[torch.Tensor] = None) -> float:
    """Largest relative change of a scale rounded to bf16 (XNNPACK's blockwise scale type);
    ``rounded``: those bf16 values as floats, when the caller has them already.

    A zero scale rounds to zero: its change, 0, over the smallest normal float is 0, so no
    mask picks the nonzero scales out (indexing by a mask copied every scale twice: an 8B
    GGUF's 224 weights took 2.7 s in it; the same answer)."""
    s = scales.float()
    if s.numel() == 0:
        return 0.0
    if rounded is None:
        rounded = s.to(torch.bfloat16).float()
    changes = (rounded - s).abs() / s.abs().clamp(min=torch.finfo(torch.float32).tiny)
    return float(changes.max())
