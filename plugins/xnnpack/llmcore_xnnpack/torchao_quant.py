"""The ``8da4w`` recipe's options and its torchao-quantized embeddings.

The linear layers themselves are built in :mod:`llmcore_xnnpack.recipes` (the integers)
and :mod:`llmcore_xnnpack.qlinear` (the graph form XNNPACK runs); this module checks the
options they share and picks each layer's group.

XNNPACK's blockwise int4 kernels need a group size that is a multiple of 32 (a group of
the whole row included), so a layer whose in-features the requested group does not divide
gets the largest multiple of 32 that does, and a layer whose in-features are not a multiple
of 32 at all stays fp32 (XNNPACK still runs it, unquantized).

Embeddings (``embedding_bits`` 8, the default, or 4): the table gets int8 or packed int4
rows with one scale per ``embedding_group_size`` columns. 8-bit tables are rounded here
into a :class:`StoredByteEmbedding`, which exports as
``quantized_decomposed::embedding_byte``; 4-bit ones use torchao's
``IntxWeightOnlyConfig`` and export as ``dequantize_affine + embedding``, which
ExecuTorch's quant-fusion pass (run by ``to_executorch``) turns into ``embedding_4bit``.
Both are kernels of ``executorch.kernels.quantized``, run by the portable runtime (XNNPACK
has no gather). A table the checkpoint already stores as int8 rows (the ``gguf`` recipe)
becomes a :class:`StoredByteEmbedding` without quantizing anything again, one it stores as
4-bit integers (Q4_0, Q4_1, Q4_K) a :class:`StoredNibbleEmbedding` (``embedding_4bit``).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmcore.errors import LlmcoreError
from llmcore.stored import float_rows, in_file, materialize
from llmcore_xnnpack.qlinear import float16_if_exact, int8_block_values

log = logging.getLogger(__name__)

XNNPACK_GROUP_MULTIPLE = 32
EMBEDDING_BITS = (0, 4, 8)


def check_options(options: dict) -> None:
    """Refuse option values the XNNPACK kernels or the runtime's embedding ops cannot take."""
    group = options["group_size"]
    if group < 0 or group % XNNPACK_GROUP_MULTIPLE:
        raise LlmcoreError(
            f"8da4w: group_size {group} is not supported: XNNPACK's int4 kernels need a multiple of "
            f"{XNNPACK_GROUP_MULTIPLE} (or 0 for one scale per output channel).",
            fix="use --quantize-option group_size=32 (or 64, 128, 256; 0 = per channel).",
        )
    check_embedding_options(options, "8da4w")


def check_embedding_options(options: dict, recipe: str) -> None:
    """``embedding_bits`` and ``embedding_group_size``, as the runtime's embedding ops take them."""
    bits = options["embedding_bits"]
    if bits not in EMBEDDING_BITS:
        raise LlmcoreError(
            f"{recipe}: embedding_bits {bits} is not supported.",
            fix="use embedding_bits=8 or 4, or 0 to keep embeddings in fp32.",
        )
    egroup = options["embedding_group_size"]
    if egroup < 0 or (bits == 4 and egroup % 2):
        raise LlmcoreError(
            f"{recipe}: embedding_group_size {egroup} is not supported"
            + (" with 4-bit embeddings, whose groups hold whole bytes" if egroup >= 0 else "")
            + ".",
            fix="use a positive even group (32 is the default), or 0 for one scale per row.",
        )


def linear_group(in_features: int, requested: int) -> Optional[int]:
    """The int4 group for a linear: ``requested`` if it divides ``in_features``, else the
    largest multiple of 32 below it that does; 0 means one group per row. None: keep fp32."""
    if in_features % XNNPACK_GROUP_MULTIPLE:
        return None
    if requested == 0 or requested >= in_features:
        return 0
    for group in range(requested, 0, -XNNPACK_GROUP_MULTIPLE):
        if in_features % group == 0:
            return group
    return None  # unreachable: 32 divides in_features


def embedding_group(dim: int, requested: int) -> int:
    """The embedding group: ``requested`` if it divides ``dim``, else 0 (one per row)."""
    if requested == 0 or requested >= dim or dim % requested:
        return 0
    return requested


def _granularity(group: int):
    from torchao.quantization.granularity import PerAxis, PerGroup

    return PerAxis(0) if group == 0 else PerGroup(group)


class QuantizedLookupEmbedding(nn.Module):
    """An ``nn.Embedding`` whose lookups read an int8 / int4 copy of its table.

    ``weight`` stays the original fp32 parameter, for a linear tied to the table or code
    that reads the table directly (nanoGPT slices its position table). ExecuTorch drops
    parameters the exported graph does not read, so the program keeps the quantized table,
    the fp32 one, or both, as the model actually uses them.
    """

    def __init__(self, embedding: nn.Embedding, config):
        super().__init__()
        from torchao.quantization import quantize_

        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.weight = embedding.weight
        table = nn.Embedding(self.num_embeddings, self.embedding_dim, _weight=embedding.weight.detach())
        with torch.no_grad():
            quantize_(table, config, filter_fn=lambda m, fqn: isinstance(m, nn.Embedding))
        self.qweight = table.weight

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return F.embedding(indices, self.qweight, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, quantized={self.qweight.__class__.__name__}"


def quantize_embeddings(module: nn.Module, bits: int, group_size: int, algorithm: str = "affine",
                        tied_int8: Optional[dict] = None) -> tuple[int, int]:
    """Give every plain ``nn.Embedding`` a quantized lookup table; returns how many got one,
    and how many of those look up a tied output layer's rows. ``tied_int8``: ``id(weight) ->
    ChannelInt8Linear`` of output layers already rounded to int8 per channel; an 8-bit table
    tied to one of them looks its rows up in that layer's integers (:func:`shared_int8_table`)."""
    from torchao.quantization.quant_api import IntxWeightOnlyConfig

    targets = [
        (name, child)
        for name, child in module.named_modules()
        if type(child) is nn.Embedding and child.max_norm is None and child.weight.dim() == 2
    ]
    done = shared = 0
    for name, child in targets:
        group = embedding_group(child.embedding_dim, group_size)
        if bits == 4 and child.embedding_dim % 2:
            log.warning("8da4w: embedding %s kept in fp32: 4-bit rows need an even width", name)
            continue
        if bits == 8 and tied_int8 and id(child.weight) in tied_int8:
            lookup = shared_int8_table(tied_int8[id(child.weight)], child.padding_idx)
            shared += 1
        elif bits == 8:
            lookup = _int8_row_table(child, group)
        else:
            materialize(child)  # torchao rounds the whole table: read it from the file if it is there
            lookup = QuantizedLookupEmbedding(child, IntxWeightOnlyConfig(
                weight_dtype=getattr(torch, f"int{bits}"),
                granularity=_granularity(group),
                intx_choose_qparams_algorithm=algorithm,
            ))
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, lookup)
        done += 1
    return done, shared


def _int8_row_table(embedding: nn.Embedding, group: int) -> "StoredByteEmbedding":
    """8-bit rows, symmetric, one scale (``amax / 127``) per ``group`` columns (0: per row):
    a GGUF's Q8_0 form, looked up by the same ``embedding_byte`` kernel as a table the
    checkpoint stores that way. Rounded here, a few rows at a time, rather than by torchao's
    ``quantize_``, whose full-size fp32 temporaries raised the export's peak
    (docs/performance.md, "Measurements behind the code"); the program's operator is the
    same."""
    table = int8_row_table(float_rows(embedding.weight).detach(), embedding.padding_idx, group)
    # the fp32 table stays readable for code that reads it itself (nanoGPT slices its
    # position table); the program keeps it only where the graph reads it. One still in the
    # checkpoint file (a recipe reading layer by layer) is not read back for that.
    if not in_file(embedding.weight):
        table.weight = embedding.weight
    return table


# Rows of a table rounded at once by int8_row_table: a few MB of fp32 at a time.
_TABLE_ROWS = 2048


def int8_row_table(weight, padding_idx: Optional[int] = None, group: int = XNNPACK_GROUP_MULTIPLE,
                   error=None) -> "StoredByteEmbedding":
    """:class:`StoredByteEmbedding` of ``weight`` (anything read by rows: a tensor, or a table
    still in its checkpoint file, :func:`llmcore.stored.float_rows`) rounded to int8 rows with
    one scale per ``group`` columns (0: per row), :data:`_TABLE_ROWS` rows at a time; the
    rounding error added to ``error`` (a :class:`~llmcore_xnnpack.qlinear.ErrorSum`) if given."""
    from llmcore_xnnpack.qlinear import int8_channels

    rows, width = weight.shape
    block = group or width
    q = torch.empty(rows, width, dtype=torch.int8)
    scales = torch.empty(rows, width // block)
    for start in range(0, rows, _TABLE_ROWS):
        part = weight[start:start + _TABLE_ROWS].float()
        part_q, part_scales = int8_channels(part.reshape(-1, block), error)
        q[start:start + len(part)] = part_q.view(len(part), width)
        scales[start:start + len(part)] = part_scales.view(len(part), -1)
    return StoredByteEmbedding(q, scales, padding_idx)


def shared_int8_table(output: "ChannelInt8Linear", padding_idx: Optional[int] = None) -> "StoredByteEmbedding":
    """The lookup table of an embedding tied to ``output`` (int8 per channel: one scale a
    row), holding the output layer's own integers, the same tensor: a program stores them
    once, as the checkpoint did. Llama-3.2-1B's tied Q6_K table as int8 rows of 32 beside
    its output layer's int8 rows was 262 MB of its 1058 MB program."""
    # the scales (4 bytes a row) copied: one tensor in two shapes, [rows] and [rows, 1], made
    # the emitter read the shared storage after it had been released
    return StoredByteEmbedding(output.q, output.scales.view(-1, 1).clone(), padding_idx)


class StoredByteEmbedding(nn.Module):
    """An embedding table kept as the checkpoint stores it: int8 rows with one scale per
    ``block`` columns (a GGUF's Q8_0, often its token embedding). The program looks rows up
    with ``quantized_decomposed::embedding_byte`` (ExecuTorch's quantized kernels), so the
    table stays a quarter of its fp32 size in the program and in memory while exporting,
    and every value equals the file's ``scale * q`` exactly (fp16 scales are exact in fp32).

    Eager calls (the parity reference) gather the rows first and dequantize only those:
    the same products, without a full fp32 copy of the table per call."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, padding_idx: Optional[int] = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = q.shape
        self.block = self.embedding_dim // scales.shape[1]
        self.padding_idx = padding_idx
        self.register_buffer("q", q.contiguous())
        # float16 scales stay so (a Q8_0 table shared with an output layer on int8 blocks:
        # embedding_byte widens them, exactly); any other kind as float32
        self.register_buffer("scales", (scales if scales.dtype == torch.float16 else scales.float()).contiguous())

    def weight_values(self, rows: slice = slice(None)) -> torch.Tensor:
        """The fp32 table the lookups give (for measuring it); ``rows`` of it."""
        return int8_block_values(self.q[rows], self.scales[rows])

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            import executorch.exir.passes._quant_patterns_and_replacements  # noqa: F401  (defines the op)

            return torch.ops.quantized_decomposed.embedding_byte.dtype(
                self.q, self.scales, None, -128, 127, indices, dtype=torch.float32)
        return int8_block_values(self.q[indices], self.scales[indices])

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 per {self.block} columns"


class StoredNibbleEmbedding(nn.Module):
    """An embedding table of 4-bit integers ``q`` in ``[-8, 7]`` with one scale per ``block``
    columns, and optionally one offset (``scale * q + offset``), kept as the checkpoint
    stores it: a GGUF's Q4_0 (the token table of an untied model, Llama-3.1-8B's 525M
    values), or Q4_1 and Q4_K (Q4_K_M's token table). Two values a byte, looked up by
    ``quantized_decomposed::embedding_4bit`` (ExecuTorch's quantized kernels). As int8 rows
    (:class:`StoredByteEmbedding`) the same table took 9 bits a value with its float32
    scales; this takes 4.5 (Q4_0: float16 scales, the file's values exactly) or 6.

    ``embedding_4bit`` reads each byte's high nibble as the even column and the low one as
    the odd column after it, both as ``u - 8`` (:func:`pack_high_first`), and computes
    ``(q - zero_point) * scale`` in float32: an offset is held as the zero point ``-offset /
    scale``, whose value differs from ``scale * q + offset`` by float rounding (a few parts
    in 2^24 of the offset, where the int4 linears round theirs to float16, 2^-11). A block
    whose scale is 0 (all its values the offset) is held as ``q = -8`` times ``-offset / 8``,
    exactly. Eager calls gather the rows first and compute only those, as the kernel does."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                 padding_idx: Optional[int] = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = q.shape
        if self.embedding_dim % 2 or self.embedding_dim % scales.shape[1]:
            raise ValueError(f"4-bit rows need an even width that the scales' blocks divide, "
                             f"not {self.embedding_dim} in {scales.shape[1]} blocks")
        self.block = self.embedding_dim // scales.shape[1]
        self.padding_idx = padding_idx
        # packed :data:`_TABLE_ROWS` rows at a time: the whole table's temporaries (twice the
        # integers' bytes) raised Llama-3.1-8B's export peak by 270 MiB
        packed = torch.empty(self.num_embeddings, self.embedding_dim // 2, dtype=torch.uint8)
        if offsets is not None:  # rewritten as zero points, row part by row part with the integers
            held_scales, zero_points = torch.empty(scales.shape), torch.empty(scales.shape)
        for start in range(0, self.num_embeddings, _TABLE_ROWS):
            rows = slice(start, start + _TABLE_ROWS)
            part_q = q[rows]
            if offsets is not None:
                part_q, held_scales[rows], zero_points[rows] = _as_zero_points(
                    part_q, scales[rows].float(), offsets[rows].float())
            packed[rows] = pack_high_first(part_q)
        if offsets is None:
            held_scales, zero_points = float16_if_exact(scales), None
        elif not (torch.isfinite(zero_points).all() and torch.isfinite(held_scales).all()):
            raise ValueError("an offset too large for its scale to be held as a zero point")
        self.register_buffer("packed", packed)
        self.register_buffer("scales", held_scales.contiguous())
        self.register_buffer("zero_points", zero_points)

    def weight_values(self, rows: slice = slice(None)) -> torch.Tensor:
        """The fp32 table the lookups give (for measuring it); ``rows`` of it."""
        return self._values(self.packed[rows], self.scales[rows],
                            None if self.zero_points is None else self.zero_points[rows])

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            import executorch.exir.passes._quant_patterns_and_replacements  # noqa: F401  (defines the op)

            return torch.ops.quantized_decomposed.embedding_4bit.dtype(
                self.packed, self.scales, self.zero_points, -8, 7, indices, dtype=torch.float32)
        return self._values(self.packed[indices], self.scales[indices],
                            None if self.zero_points is None else self.zero_points[indices])

    @staticmethod
    def _values(packed: torch.Tensor, scales: torch.Tensor, zero_points: Optional[torch.Tensor]) -> torch.Tensor:
        q = unpack_high_first(packed)
        if zero_points is None:
            return int8_block_values(q, scales)
        blocks = q.float().unflatten(-1, (scales.shape[-1], -1))  # (q - zero_point) * scale, the kernel's order
        return ((blocks - zero_points.unsqueeze(-1)) * scales.unsqueeze(-1)).flatten(-2)

    def extra_repr(self) -> str:
        kind = "int4 + zero points" if self.zero_points is not None else "int4"
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind} per {self.block} columns"


def _as_zero_points(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor):
    """Rows of ``scale * q + offset`` blocks as ``embedding_4bit`` takes them: ``(q, scales,
    zero points)`` with ``(q - zero_point) * scale`` the values (see
    :class:`StoredNibbleEmbedding`); a block of scale 0 becomes ``-8 * (-offset / 8)``."""
    flat = scales == 0
    zero_points = torch.where(flat, torch.zeros_like(offsets), -offsets / torch.where(flat, 1.0, scales))
    held = torch.where(flat, -offsets / 8, scales)
    blocks = q.unflatten(-1, (scales.shape[-1], -1))
    q = torch.where(flat.unsqueeze(-1), torch.full_like(blocks, -8), blocks).flatten(-2)
    return q, held, zero_points


def pack_high_first(q: torch.Tensor) -> torch.Tensor:
    """int8 ``[..., cols]`` in [-8, 7] -> uint8 ``[..., cols / 2]`` as ``embedding_4bit`` reads
    them: ``q + 8`` of each even column in the high nibble, of the odd column after it in the
    low one (the other order from the int4 linears' :func:`.qlinear.pack_nibbles`)."""
    u = (q + 8).to(torch.uint8)
    return ((u[..., 0::2] << 4) | u[..., 1::2]).contiguous()


def unpack_high_first(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_high_first`."""
    q = torch.empty(*packed.shape[:-1], 2 * packed.shape[-1], dtype=torch.uint8)
    q[..., 0::2] = packed >> 4
    q[..., 1::2] = packed & 0x0F
    return q.view(torch.int8).sub_(8)
