"""The ``8da4w-mlp`` recipe's rewrite: each gated MLP of int4 linears -> ``llmcore::int4_mlp``.

The ``8da4w`` recipe (llmcore-xnnpack) gives every linear int4 blocks of 32 that XNNPACK
runs. This recipe runs that recipe unchanged, then hands each SwiGLU MLP
(``down(silu(gate(x)) * up(x))``, three :class:`~llmcore_xnnpack.qlinear.BlockInt4Linear`)
to llmcore's own kernel as one operator, with the same integers and bf16 scales: its GEMM
multiplies 32 int8 x int4 products an instruction where XNNPACK's AVX2 kernel multiplies 16
(docs/performance.md, "An int4 GEMM of our own"). The attention projections stay in
XNNPACK: taking them out too would cut each block's delegated graph into more pieces.

A module qualifies when it has the three projections under Llama's names (``w1`` gate,
``w3`` up, ``w2`` down) or Hugging Face's (``gate_proj``, ``up_proj``, ``down_proj``), each
int4 with blocks of 32, no per-block offsets, no bias and no outlier split, and when on a
random input it gives what the kernel gives (a GeGLU MLP does not). The recipe refuses a
model with an MLP the kernel cannot take, rather than leave part of it to XNNPACK unsaid.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from llmcore.errors import LlmcoreError
from llmcore.modules import replace_modules
from llmcore.stored import q4_k_block_values
from llmcore_xnnpack.qlinear import (Q6_K_VALUES, BlockInt4Linear, BlockInt8Linear, ChannelInt8Linear,
                                     StoredBlocksLinear, float16_values, kernels_rounding, relative_error)

RECIPE = "8da4w-mlp"
BLOCK = 32  # the kernel's int4 block (csrc/int4_gemm.h)
# int8 rows' in-features stay below it, for exact 32-bit sums (csrc/int4_gemm.h, kInt8MaxK)
INT8_MAX_IN = 65536
NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))  # gate, up, down
# ||kernel - module|| / ||module|| allowed in the swap check: both round their activations to
# int8, and a value within float error of a rounding boundary may land on either side.
CHECK_TOLERANCE = 2e-3
QUANTIZED_LINEARS = (BlockInt4Linear, ChannelInt8Linear, BlockInt8Linear, StoredBlocksLinear)
# rows of an int4 weight whose block sums (pack) are taken at once: their temporaries are a few
# MiB, which the heap reuses from one slice to the next (16384 rows of nibbles as 4096-row
# slices took 48 MiB of fresh pages, as 1024-row ones 11 MiB)
_SUM_ROWS = 1024


def pack(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed, scales, row_sums)`` of an int4 weight ``scales[o, i // 32] * q[o, i]`` in the
    kernel's layout: the nibbles ``q + 8`` in the order the kernel reads them, packed by the
    kernel's own code (``llmcore::int4_pack``; the layout: ``csrc/int4_gemm.h``); the scales
    as bfloat16 (exact: the modules keep them bf16-rounded); each row's sum of weights, which
    the kernel needs for the activations' zero points. ``q`` is int8 ``[rows, cols]``, or the
    same integers two to a byte (uint8 ``[rows, cols / 2]``, as
    :func:`~llmcore_xnnpack.qlinear.pack_nibbles` holds them), packed without unpacking."""
    nibbles = q.dtype == torch.uint8
    rows, cols = q.shape[0], q.shape[1] * (2 if nibbles else 1)
    if cols % BLOCK or scales.shape != (rows, cols // BLOCK):
        raise ValueError(f"a [{rows}, {cols}] int4 weight needs [{rows}, {cols // BLOCK}] scales, got {tuple(scales.shape)}")
    packed = _packed(q)
    bf16 = scales.to(torch.bfloat16)
    if not torch.equal(bf16.float(), scales.float()):
        raise ValueError("int4 scales must be bfloat16 values")
    return packed, bf16.contiguous(), _row_sums(q, scales, nibbles)


def _packed(q: torch.Tensor) -> torch.Tensor:
    """Int4 integers (int8, or two to a byte as uint8) in the kernel's layout, by its own code."""
    from llmcore_kernels import ops  # noqa: F401  registers llmcore::int4_pack

    return torch.ops.llmcore.int4_pack.default(q.contiguous() if q.dtype == torch.uint8 else
                                               q.to(torch.int8).contiguous())


def _row_sums(q: torch.Tensor, scales: torch.Tensor, nibbles: bool) -> torch.Tensor:
    """Each row's sum of the int4 part ``scales * q``, float32: the integers of each block
    summed exactly (int16: at most 32 x 15), times the block's scale, in float64; a slice of
    rows at a time (no float64 copy of the weight: 470 MB for one of Llama-3.1-8B's MLP
    matrices)."""
    sums = (torch.cat([_block_sums(part, nibbles) for part in q.split(_SUM_ROWS)]).double() * scales.double()).sum(1)
    return sums.float().contiguous()


def _block_sums(q: torch.Tensor, nibbles: bool) -> torch.Tensor:
    """Each block's sum of integers, int16 ``[rows, cols / 32]``, from int8 ``q`` or its nibbles."""
    if nibbles:  # each byte holds two integers plus 8
        values = (q & 0x0F).to(torch.int16).add_(q >> 4)
        return values.view(len(q), -1, BLOCK // 2).sum(-1, dtype=torch.int16).sub_(8 * BLOCK)
    return q.view(len(q), -1, BLOCK).to(torch.int16).sum(-1, dtype=torch.int16)


def register_packed(module: nn.Module, name: str, q: torch.Tensor, scales: torch.Tensor) -> None:
    """:func:`pack` ``q`` and ``scales`` into ``module``'s buffers ``name``, ``name_scales`` and
    ``name_sums``, the three tensors an operator takes for one projection."""
    packed, bf16, sums = pack(q, scales)
    module.register_buffer(name, packed)
    module.register_buffer(f"{name}_scales", bf16)
    module.register_buffer(f"{name}_sums", sums)


def register_q4_k(module: nn.Module, name: str, q: torch.Tensor, headers: torch.Tensor) -> None:
    """A Q4_K weight (integers ``q`` as :func:`pack` takes them, the file's super-block
    ``headers`` uint8 ``[rows, in/256, 16]``) into ``module``'s buffers ``name`` (the nibbles
    packed as int4 blocks'), ``name_scales`` (the headers themselves: the kernels compute each
    block's scale and offset from them, csrc/int4_gemm.h ``Format::q4_k``) and ``name_sums``
    (each row's sum of the int4 part, with the exact scales). No offsets tensor: the headers
    hold the minima."""
    scales, _ = q4_k_block_values(headers)
    module.register_buffer(name, _packed(q))
    module.register_buffer(f"{name}_scales", headers.contiguous())
    module.register_buffer(f"{name}_sums", _row_sums(q, scales.reshape(len(q), -1), q.dtype == torch.uint8))


def register_int8(module: nn.Module, name: str, q: torch.Tensor, scales: torch.Tensor) -> None:
    """An int8 weight ``scales[o] * q[o, i]`` into ``module``'s buffers ``name`` (``q`` as it is,
    the kernel's int8 rows: csrc/int4_gemm.h), ``name_scales`` and ``name_sums`` (each row's sum
    of weights, for the activations' zero points)."""
    scales = scales.float().reshape(-1)
    if q.dim() != 2 or scales.shape != (q.shape[0],):
        raise ValueError(f"an int8 weight {tuple(q.shape)} needs one scale a row, got {tuple(scales.shape)}")
    integers = q.to(torch.int8).contiguous()
    module.register_buffer(name, integers)
    module.register_buffer(f"{name}_scales", scales.contiguous())
    # each row's integers summed exactly (int32 holds 127 x 65536, INT8_MAX_IN) by an int8 GEMM
    # with a column of ones: sum() casts what it sums first, and those copies, a slice of rows
    # at a time, were not reused by the heap in one run of two (the output layer of the
    # llama-300m shape: +370 MiB on the export's peak)
    ones = torch.ones(q.shape[1], 8, dtype=torch.int8)  # _int_mm takes 8 columns at least
    sums = torch._int_mm(integers, ones)[:, 0].double() * scales.double()
    module.register_buffer(f"{name}_sums", sums.float().contiguous())


def register_int8_blocks(module: nn.Module, name: str, q: torch.Tensor, scales: torch.Tensor) -> None:
    """An int8 weight ``scales[o, i // 32] * q[o, i]`` (a Q8_0 table) into ``module``'s buffers
    ``name`` and ``name_scales`` (the tensors themselves: a tied table's lookups read them too,
    one constant in the program; the kernel's int8 blocks, csrc/int4_gemm.h) and ``name_sums``
    (each row's sum of weights), summed a slice of rows at a time (a whole int32 copy of
    Gemma-3-1B's table would be 1.2 GB on the export's peak)."""
    sums = torch.cat([part.view(len(part), -1, BLOCK).sum(-1, dtype=torch.int32).double().mul_(s.double()).sum(1)
                      for part, s in zip(q.split(_SUM_ROWS), scales.split(_SUM_ROWS))])
    module.register_buffer(name, q)
    module.register_buffer(f"{name}_scales", scales)
    module.register_buffer(f"{name}_sums", sums.float().contiguous())


_Q6_K_SUMS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a file's Q6_K blocks -> their rows' sums


def q6_k_row_sums(blocks: torch.Tensor) -> torch.Tensor:
    """Each row's sum of weights of a Q6_K weight held as the file's super-blocks (uint8
    ``[rows, in/256, 210]``, which the kernels read as they are), float32, summed in float64
    from the values ``llmcore::q6_k_embedding`` decodes; made once a tensor."""
    sums = _Q6_K_SUMS.get(blocks)
    if sums is None:
        ids = torch.arange(blocks.shape[0])
        sums = torch.empty(blocks.shape[0], dtype=torch.float64)
        for part in ids.split(_SUM_ROWS):  # a slice's values at a time: 8 MiB at 2048 wide
            torch.sum(torch.ops.llmcore.q6_k_embedding.default(blocks, part), 1, dtype=torch.float64,
                      out=sums[part[0]:part[-1] + 1])
        sums = _Q6_K_SUMS[blocks] = sums.float()
    return sums


def register_linears(module: nn.Module, name: str, linears: list[nn.Module], interleave: bool = False) -> None:
    """The linears' rows stacked (or, with ``interleave``, two linears' rows interleaved, as
    ``gate_up``'s: :func:`interleave_rows`) into one projection's four buffers: int4 blocks
    when they are :class:`BlockInt4Linear`, int8 rows when :class:`ChannelInt8Linear`, int8
    blocks when :class:`BlockInt8Linear` (a tied Q8_0 table: its tensors themselves), Q4_K
    when every one is a :class:`BlockInt4Linear` that kept its file's headers
    (:func:`register_q4_k`), and
    ``name_offsets`` (:func:`stacked_offsets`; None without any). An int4 linear's blocks are
    taken in :func:`signed_form`: a Q4_0 file's negative scales are the kernels' again."""

    if len(linears) == 1 and isinstance(linears[0], StoredBlocksLinear):  # the output layer's Q6_K
        blocks = linears[0].blocks  # the file's tensor itself: a tied table's lookups read it too
        module.register_buffer(name, blocks)
        module.register_buffer(f"{name}_scales", torch.empty(0, dtype=torch.float16))  # the blocks hold their d
        module.register_buffer(f"{name}_sums", q6_k_row_sums(blocks))
        module.register_buffer(f"{name}_offsets", None)
        return
    int8_blocks = all(isinstance(p, BlockInt8Linear) for p in linears)
    int8 = all(isinstance(p, ChannelInt8Linear) for p in linears)
    q4_k = all(isinstance(p, BlockInt4Linear) and p.q4_k_headers is not None for p in linears)
    if q4_k:  # the file's integers and headers: the exact scales and offsets, computed by the kernels
        held_as_nibbles = all(p.q is None for p in linears)
        parts = [(p.q_nibbles if held_as_nibbles else p.integers(), p.q4_k_headers, None) for p in linears]
    elif int8 or int8_blocks:
        parts = [(p.q, p.scales, None) for p in linears]
    else:  # two to a byte where all are held so (rows are rows either way), else int8
        held_as_nibbles = all(p.q is None for p in linears)
        parts = [signed_form(p, held_as_nibbles) for p in linears]

    def stacked(i: int) -> torch.Tensor:
        tensors = [part[i] for part in parts]
        if len(tensors) == 1:  # the tensor itself, not a copy: a tied table's rows stay one tensor
            return tensors[0]
        return interleave_rows(*tensors) if interleave else torch.cat(tensors)

    if q4_k:
        register_q4_k(module, name, stacked(0), stacked(1))
    elif int8_blocks:
        register_int8_blocks(module, name, stacked(0), stacked(1))
    elif int8:
        register_int8(module, name, stacked(0), stacked(1))
    else:
        register_packed(module, name, stacked(0), stacked(1))
    offsets = [part[2] for part in parts]
    module.register_buffer(f"{name}_offsets", stacked_offsets(offsets, [p.out_features for p in linears],
                                                             linears[0].in_features // BLOCK, interleave))


def signed_form(p: BlockInt4Linear, nibbles: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(integers, scales, offset_weight or None)`` of an int4 linear as the kernels take it.

    XNNPACK takes positive scales only, so a :class:`BlockInt4Linear` made for it (int8
    integers, or after ``unpack_()``) holds a Q4_0 block whose scale ``d`` is negative (about
    half of a real model's: llama.cpp writes ``d = max / -8``) as ``|d| (~q) + |d|``, an
    offset the size of its scale; held two to a byte it keeps ``d`` and ``q``. The kernels
    multiply by a scale of either sign, so where every offset of a linear is such (or zero)
    its blocks go back to ``d`` and ``q``: the same weights, without offsets to store (2
    bytes a block beside its 18) and add (a prompt's pass over every block's mean: a sixth
    of a real Q4_0's prefill, docs/performance.md, "Q4_0's negative scales"). A linear with
    offsets of its own (Q4_1's minima) keeps its form whole: the few of its blocks whose
    minimum happens to make the offset equal the scale (0.2% of SmolLM2's Q4_1) would save
    nothing, and moving them cost `make demo`'s program perplexity (+1.27% -> +2.21%
    against fp32, KL 0.01827 -> 0.01939). The integers are the module's (int8, or two to a
    byte with ``nibbles``: ``~`` of a byte is ``~`` of both its nibbles)."""
    q = p.q_nibbles if nibbles else p.integers()
    scales, offsets = p.int4_block_form()  # (a Q4_K layer's headers' values, in a stack of other kinds)
    if offsets is None:
        return q, scales, None
    offsets = offsets.detach()
    flip = offsets == scales * p.block  # offset_weight is the offset times the block
    if not bool((flip | (offsets == 0)).all()):  # offsets of its own (Q4_1's minima) stay, all
        return q, scales, offsets
    blocks = q.view(q.shape[0], flip.shape[1], -1)
    q = torch.where(flip.unsqueeze(-1), torch.bitwise_not(blocks), blocks).view(q.shape)
    return q, torch.where(flip, -scales, scales), None


@contextmanager
def computing_as_the_kernels(module: nn.Module) -> Iterator[None]:
    """Every int4 linear under ``module`` in :func:`signed_form`, rounding its activations per
    block as the kernels do (:func:`llmcore_xnnpack.qlinear.kernels_rounding`), while the block
    is open: the eager reference a swap check compares the kernels with
    (``layers._swap_checked``).

    Both forms hold the same weights, but a product differs by how the activations' int8
    rounding meets them: a block's offset multiplies the fp32 activations, its integers the
    rounded ones. On a real Q4_0 model's linears the two forms are equally far from the
    fp32 product (0.7% on random inputs; the signed form a little nearer), 0.16% from each
    other, which a layer's attention and gate amplify past the layer check's tolerance
    (0.024-0.036 on SmolLM2's layers). Against its own form a kernel layer is a float
    summation order away. A linear whose form the kernels keep (its offsets its own) is left
    as it is, and so is one that kept a GGUF's Q4_K headers (it computes with their exact
    values, as the kernels do: :func:`register_q4_k`)."""
    kept = []
    for p in module.modules():
        if not (isinstance(p, BlockInt4Linear) and p.offset_weight is not None):
            continue
        q, scales, offsets = signed_form(p, p.q is None)
        if offsets is not None:
            continue
        kept.append((p, p.q, p.q_nibbles, p.scales, p.offset_weight))
        if p.q is None:
            p.q_nibbles = q
        else:
            p.q = q
        p.scales, p.offset_weight = scales, None
    try:
        with kernels_rounding():
            yield
    finally:
        for p, q, q_nibbles, scales, offset_weight in kept:
            p.q, p.q_nibbles, p.scales, p.offset_weight = q, q_nibbles, scales, offset_weight


def stacked_offsets(offsets: list[Optional[torch.Tensor]], rows: list[int], blocks: int,
                    interleave: bool = False) -> Optional[torch.Tensor]:
    """Linears' ``offset_weight`` rows (``offsets``, None for a linear without; ``rows`` each
    one's rows) one after another, or the rows of two interleaved as ``gate_up``'s are, in the
    kernel's layout ``[ceil(rows/8), in/32, 8]`` (csrc/int4_gemm.h: eight rows side by side,
    zeros past the last), in float16, the values the modules hold (``float16_offsets``; a
    linear whose are not stays on XNNPACK: :func:`why_not_linear`); None when none has any."""
    if all(o is None for o in offsets):
        return None
    parts = [o.float() if o is not None else torch.zeros(n, blocks) for o, n in zip(offsets, rows)]
    stacked = interleave_rows(*parts) if interleave else torch.cat(parts)
    if not float16_values(stacked):
        raise ValueError("block offsets that are not float16 values reached the kernels (why_not_linear refuses them)")
    n = stacked.shape[0]
    padded = torch.zeros((n + 7) // 8 * 8, blocks, dtype=torch.float16)
    padded[:n] = stacked
    return padded.view(-1, 8, blocks).transpose(1, 2).contiguous()


def register_mlp(module: nn.Module, gate: nn.Module, up: nn.Module, down: nn.Module) -> None:
    """The MLP's ``gate_up`` (rows interleaved, :func:`interleave_rows`) and ``down`` buffers on
    ``module``, as ``llmcore::int4_mlp`` and ``llmcore::int4_norm_mlp_add`` take them."""
    register_linears(module, "gate_up", [gate, up], interleave=True)
    register_linears(module, "down", [down])


def interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Row 2j gate's row j, row 2j + 1 up's: the thread that computes both has silu(gate) * up."""
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


class FusedInt4MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` through ``llmcore::int4_mlp``, from three int4 linears."""

    def __init__(self, gate: BlockInt4Linear, up: BlockInt4Linear, down: BlockInt4Linear):
        super().__init__()
        self.dim, self.hidden = gate.in_features, gate.out_features
        register_mlp(self, gate, up, down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llmcore.int4_mlp.default(
            x, self.gate_up, self.gate_up_scales, self.gate_up_sums, self.down, self.down_scales, self.down_sums
        )

    def extra_repr(self) -> str:
        return f"{self.dim} -> {self.hidden} -> {self.dim}, int4 blocks of {BLOCK}"


def projections(module: nn.Module) -> Optional[tuple[nn.Module, nn.Module, nn.Module]]:
    """The module's gate, up and down children under one of ``NAMES``, or None."""
    for names in NAMES:
        parts = [getattr(module, n, None) for n in names]
        if all(p is not None for p in parts):
            return tuple(parts)
    return None


def why_not_linear(role: str, p: nn.Module, offsets: bool = False, int8: bool = False,
                   int8_blocks: bool = False) -> Optional[str]:
    """Why the kernels cannot take linear ``p`` (its ``role`` named in the reason), or None:
    int4 blocks of 32, with offsets only when ``offsets``; int8 per channel only when ``int8``
    (the layer operators take both, ``llmcore::int4_mlp`` neither); int8 blocks of 32 (a Q8_0
    table's) only when ``int8_blocks`` (``llmcore::int4_linear`` alone: no prompt tiles); no
    outlier split."""
    if isinstance(p, StoredBlocksLinear):
        if not int8_blocks:
            return f"its {role} holds the file's {p.format} (only the output layer's operator takes it)"
        if p.format != "Q6_K" or p.in_features % Q6_K_VALUES:
            return f"its {role} holds the file's {p.format}, {p.in_features} wide (the kernels take Q6_K " \
                   f"in multiples of {Q6_K_VALUES})"
        return None
    if isinstance(p, BlockInt8Linear):
        if not int8_blocks:
            return f"its {role} holds int8 blocks of {p.block} (only the output layer's operator takes them)"
        return None if p.in_features < INT8_MAX_IN else (
            f"its {role} takes {p.in_features} inputs (the int8 kernel: below {INT8_MAX_IN})")
    kinds = (BlockInt4Linear, ChannelInt8Linear) if int8 else (BlockInt4Linear,)
    if not isinstance(p, kinds):
        return f"its {role} is a {type(p).__name__}, not an int4{' or int8' if int8 else ''} linear"
    if p.outlier_split:
        return "its linears split outliers (outlier_split=true)"
    if isinstance(p, ChannelInt8Linear):
        return None if p.in_features % BLOCK == 0 and p.in_features < INT8_MAX_IN else (
            f"its {role} takes {p.in_features} inputs (the int8 kernel: a multiple of {BLOCK} below {INT8_MAX_IN})")
    if p.block != BLOCK:
        return f"its int4 blocks are {p.block} wide (the kernel's are {BLOCK}: group_size=32)"
    if p.has_offsets and not offsets:
        return "its int4 blocks have offsets (asymmetric=true)"
    if p.offset_weight is not None and not float16_values(p.offset_weight):
        # only a layer unpack_()ed for XNNPACK with offsets of its own and a negative scale
        return "its int4 blocks' offsets are not float16 values (the kernels store them so)"
    return None


def why_not(gate: nn.Module, up: nn.Module, down: nn.Module, offsets: bool = False,
            int8: bool = False) -> Optional[str]:
    """Why the kernel cannot take these projections, or None (:func:`why_not_linear`'s terms;
    gate and up of one kind, stacked into one weight)."""
    for role, p in (("gate", gate), ("up", up), ("down", down)):
        reason = why_not_linear(f"{role} projection", p, offsets, int8)
        if reason is not None:
            return reason
        if p.bias is not None:
            return f"its {role} projection has a bias"
    if type(gate) is not type(up):
        return "its gate and up projections are of different kinds (int4 and int8)"
    if up.in_features != gate.in_features or up.out_features != gate.out_features:
        return "gate and up differ in shape"
    if down.in_features != gate.out_features or down.out_features != gate.in_features:
        return "down does not map the hidden size back"
    if gate.in_features % BLOCK or gate.out_features % BLOCK:
        return f"its sizes are not multiples of {BLOCK}"
    return None


def _same_function(module: nn.Module, fused: FusedInt4MLP) -> Optional[str]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, fused.dim, generator=generator)
    with torch.no_grad(), computing_as_the_kernels(module):
        expected = module(x)
        got = fused(x)
    error = relative_error(got, expected)
    return None if error <= CHECK_TOLERANCE else f"differs from the kernel by {error:.2g} (relative)"


def swap_mlps(model: nn.Module) -> tuple[int, list[str]]:
    """Replace qualifying MLPs in place; returns (how many, why others were kept). Loads the
    kernel library (``LlmcoreError`` with the fix when it is not built)."""
    from llmcore_kernels import ops  # noqa: F401  registers llmcore::int4_mlp

    names = {id(m): n for n, m in model.named_modules()}
    kept: list[str] = []

    def fused_or_none(child: nn.Module) -> Optional[FusedInt4MLP]:
        parts = projections(child)
        reason = why_not(*parts)
        fused = None if reason else FusedInt4MLP(*parts)
        reason = reason or _same_function(child, fused)
        if reason is not None:
            kept.append(f"{names[id(child)]}: {reason}")
            return None
        return fused

    swapped = replace_modules(model, lambda m: projections(m) is not None, fused_or_none)
    return swapped, kept


def apply(module: nn.Module) -> nn.Module:
    swapped, kept = swap_mlps(module)
    if swapped == 0:
        detail = f" Kept: {'; '.join(kept[:3])}." if kept else " It has none with gate, up and down projections."
        raise LlmcoreError(
            f"{RECIPE}: no MLP of the model can run on llmcore::int4_mlp.{detail}",
            stage="quantize",
            fix="use --quantize 8da4w; 8da4w-mlp takes SwiGLU MLPs with the recipe's defaults "
            "(group_size=32, asymmetric=false, outlier_split=false).",
        )
    if kept:
        raise LlmcoreError(
            f"{RECIPE}: {len(kept)} MLP(s) cannot run on llmcore::int4_mlp ({'; '.join(kept[:3])}).",
            stage="quantize",
            fix="use --quantize 8da4w for this model.",
        )
    return module
