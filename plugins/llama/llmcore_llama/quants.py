"""Vectorised dequantisation of GGML tensor types, in torch.

Each function takes the raw bytes of a tensor (``uint8``, any shape whose total size is
a whole number of blocks) and returns float32 values in storage order; the caller
reshapes them. Block layouts follow ggml's ``block_q*`` structs (little-endian):

=======  =====  ===========================================================
type     bytes  layout per block
=======  =====  ===========================================================
Q8_0     34     f16 d, int8 q[32]                        x = d*q
Q4_0     18     f16 d, u8 qs[16] (lo nibbles 0..15, hi 16..31)  x = d*(q-8)
Q4_1     20     f16 d, f16 m, u8 qs[16]                  x = d*q + m
Q5_0     22     f16 d, u32 qh (5th bits), u8 qs[16]      x = d*(q-16)
Q5_1     24     f16 d, f16 m, u32 qh, u8 qs[16]          x = d*q + m
Q4_K     144    f16 d, f16 dmin, u8 scales[12] (8 x 6-bit scale/min),
                u8 qs[128]; 256 values in 8 sub-blocks of 32
Q5_K     176    as Q4_K plus u8 qh[32] (5th bits) before qs[128]
Q6_K     210    u8 ql[128], u8 qh[64], int8 scales[16], f16 d; 256 values
=======  =====  ===========================================================

Other types that ``gguf.quants`` can dequantize (Q2_K, Q3_K, the IQ types, ...) go through
it instead: correct, but numpy-slow, so the first tensor of each such type logs a warning.
Block sizes come from ``gguf.GGML_QUANT_SIZES``.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import gguf
import numpy as np
import torch

from llmcore.stored import Q4_K_HEADER_BYTES, k_quant_codes, q4_k_block_values

Q = gguf.GGMLQuantizationType
F32, F16, BF16 = int(Q.F32), int(Q.F16), int(Q.BF16)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = int(Q.Q4_0), int(Q.Q4_1), int(Q.Q5_0), int(Q.Q5_1), int(Q.Q8_0)
Q4_K, Q5_K, Q6_K = int(Q.Q4_K), int(Q.Q5_K), int(Q.Q6_K)
FLOAT_TYPES = (F32, F16, BF16)

log = logging.getLogger(__name__)
_warned: set[int] = set()  # types already reported as taking gguf's slow path


def _as_u8(raw) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw.contiguous().view(torch.uint8).reshape(-1)
    arr = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if not arr.flags.writeable:  # memory-mapped file: torch wants writable memory
        arr = arr.copy()
    return torch.from_numpy(arr)


def _f16(cols: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 from ``[N, 2]`` bytes -> float32 ``[N, 1]``."""
    return cols.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[N, 16]`` bytes -> ``[N, 32]``: low nibbles first, then high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _nibble_integers(qs: torch.Tensor) -> torch.Tensor:
    """``[N, 16]`` bytes -> int8 ``[N, 32]``, each nibble minus 8 (low nibbles first), written
    into one tensor: made by :func:`_nibbles` and two conversions, the integers of
    Llama-3.1-8B's Q4_0 embedding table took 1.5 GB of temporaries for a 0.5 GB result."""
    out = torch.empty(qs.shape[0], 32, dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=out[:, :16])
    torch.bitwise_right_shift(qs, 4, out=out[:, 16:])
    return out.view(torch.int8).sub_(8)


def _blocks(raw: torch.Tensor, nbytes: int) -> torch.Tensor:
    if raw.numel() % nbytes:
        raise ValueError(f"{raw.numel()} bytes is not a whole number of {nbytes}-byte blocks")
    return raw.view(-1, nbytes)


def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 34)
    return (_f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()).reshape(-1)


def _nibbles_float(qs: torch.Tensor) -> torch.Tensor:
    """``[N, 16]`` bytes -> float32 ``[N, 32]`` (low nibbles, then high), written in one pass."""
    out = torch.empty(qs.shape[0], 32, dtype=torch.float32)
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4
    return out


def dequantize_q4_0(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 18)
    q = _nibbles_float(b[:, 2:]).sub_(8.0)
    return q.mul_(_f16(b[:, :2])).reshape(-1)


def dequantize_q4_1(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 20)
    q = _nibbles_float(b[:, 4:])
    return q.mul_(_f16(b[:, :2])).add_(_f16(b[:, 2:4])).reshape(-1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """``[N, 4]`` bytes of a little-endian uint32 -> its 32 bits ``[N, 32]`` (bit j = value j)."""
    bits = (qh.unsqueeze(-1).to(torch.int32) >> torch.arange(8, dtype=torch.int32)) & 1
    return bits.reshape(qh.shape[0], 32)


def dequantize_q5_0(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 22)
    q = (_nibbles(b[:, 6:]).to(torch.int32) | (_fifth_bits(b[:, 2:6]) << 4)).float() - 16.0
    return (_f16(b[:, :2]) * q).reshape(-1)


def dequantize_q5_1(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 24)
    q = (_nibbles(b[:, 8:]).to(torch.int32) | (_fifth_bits(b[:, 4:8]) << 4)).float()
    return (_f16(b[:, :2]) * q + _f16(b[:, 2:4])).reshape(-1)


def dequantize_q4_k(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 144)
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = k_quant_codes(b[:, 4:16])
    qs = b[:, 16:].reshape(n, 4, 32)  # four chunks of 64 values
    q = torch.stack((qs & 0x0F, qs >> 4), dim=2).reshape(n, 8, 32).float()  # sub-block j
    scale = (d * sc.float()).unsqueeze(-1)
    offset = (dmin * mn.float()).unsqueeze(-1)
    return (scale * q - offset).reshape(-1)


def dequantize_q5_k(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 176)
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = k_quant_codes(b[:, 4:16])
    qh = b[:, 16:48].to(torch.int32)  # [n, 32]: bit j of qh[l] is the 5th bit of sub-block j, lane l
    qs = b[:, 48:].reshape(n, 4, 32).to(torch.int32)
    low = torch.stack((qs & 0x0F, qs >> 4), dim=2).reshape(n, 8, 32)
    high = (qh.unsqueeze(1) >> torch.arange(8, dtype=torch.int32).view(1, 8, 1)) & 1
    q = (low | (high << 4)).float()
    scale = (d * sc.float()).unsqueeze(-1)
    offset = (dmin * mn.float()).unsqueeze(-1)
    return (scale * q - offset).reshape(-1)


def dequantize_q6_k(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 210)
    n = b.shape[0]
    # Each half of a block: 64 bytes ``ql`` (two rows of 32, a and b) and 32 bytes ``qh``.
    # Quarter k = 2 * nibble + row of the half takes ``ql``'s low (nibble 0) or high
    # (nibble 1) nibbles of row a or b, and bits 2k, 2k + 1 of ``qh`` above them. Built in
    # uint8 and converted once: the int32 version spent 3x as long (its temporaries are 4x
    # the bytes), a visible part of a 1B GGUF's export with a Q6_K table.
    ql = b[:, 0:128].reshape(n, 2, 2, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 1, 32)
    q = torch.empty(n, 2, 2, 2, 32, dtype=torch.uint8)  # [block, half, nibble, row, lane]
    q[:, :, 0] = ql & 0x0F
    q[:, :, 1] = ql >> 4
    q |= ((qh >> _Q6_K_HIGH_SHIFTS) & 3) << 4
    # within a half, quarter k and lane l use scale index 2k + l // 16
    scales = b[:, 192:208].contiguous().view(torch.int8).reshape(n, 2, 4, 2, 1).float()
    d = _f16(b[:, 208:210]).reshape(n, 1, 1, 1, 1)
    w = (q.view(n, 2, 4, 2, 16).view(torch.int8) - 32).float()
    return w.mul_(d * scales).reshape(-1)


_Q6_K_HIGH_SHIFTS = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8).view(1, 1, 2, 2, 1)


# ---- the integers themselves ------------------------------------------------------------
# For the types a 4-bit or 8-bit kernel can take as they are, the stored integers and
# per-32 scales (llmcore.stored.IntegerWeight: w = scale * q + offset per block), so a recipe
# can put them in a program without rounding the dequantized floats again. 4-bit integers
# are moved to [-8, 7] and the 8 into the offset: w = d*u + m = d*(u - 8) + (m + 8d).


def integers_q8_0(raw: torch.Tensor) -> tuple:
    b = _blocks(raw, 34)
    return b[:, 2:].contiguous().view(torch.int8), _f16(b[:, :2]), None


def integers_q4_0(raw: torch.Tensor) -> tuple:
    b = _blocks(raw, 18)
    return _nibble_integers(b[:, 2:]), _f16(b[:, :2]), None


def integers_q4_1(raw: torch.Tensor) -> tuple:
    b = _blocks(raw, 20)
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return _nibble_integers(b[:, 4:]), d, m + 8.0 * d


def integers_q4_k(raw: torch.Tensor) -> tuple:
    b = _blocks(raw, 144)
    n = b.shape[0]
    scale, offset = q4_k_block_values(b[:, :Q4_K_HEADER_BYTES])
    qs = b[:, Q4_K_HEADER_BYTES:].reshape(n, 4, 32)
    u = torch.stack((qs & 0x0F, qs >> 4), dim=2).reshape(n * 8, 32).to(torch.int8)
    return u - 8, scale.reshape(n * 8, 1), offset.reshape(n * 8, 1)


INTEGER_READERS: dict[int, tuple[int, Callable[[torch.Tensor], tuple]]] = {
    Q8_0: (8, integers_q8_0),
    Q4_0: (4, integers_q4_0),
    Q4_1: (4, integers_q4_1),
    Q4_K: (4, integers_q4_k),
}
"""type -> (bits, reader): the types whose integers a program can carry unchanged."""


KEPT_AS_STORED = (Q6_K,)
"""The types whose bytes a loader hands over as the file stores them
(:attr:`llmcore.stored.FileWeight.read_blocks`): Q6_K, which llmcore-kernels computes as it
is (a Q4_K_M file's output layer and the token table tied to it)."""

HEADERS_KEPT = {Q4_K: Q4_K_HEADER_BYTES}
"""type -> bytes of each super-block's header that its IntegerWeight keeps as the file stores
them (:attr:`llmcore.stored.IntegerWeight.headers`): Q4_K's d, dmin and 6-bit codes, which
llmcore-kernels computes the scales and offsets from, read with the integers (one pass over
the file's bytes)."""


def integer_weight(raw, qtype: int, shape, source_name: str, decoded: Optional[Callable[[int, int], None]] = None):
    """The stored form of a 2-D GGML tensor (:mod:`llmcore.stored`): its integers and
    scales where :data:`INTEGER_READERS` reads the type, else only the type's name.
    ``decoded(first, stop)`` is called after each slice of a file's rows is decoded (the
    loader drops those rows' file pages, which count in resident memory)."""
    from llmcore.stored import IntegerWeight, StoredFormat

    qtype = int(qtype)
    entry = INTEGER_READERS.get(qtype)
    if entry is None or len(shape) != 2:
        return StoredFormat(type_name(qtype), source_name)
    bits, read = entry
    rows, cols = (int(x) for x in shape)
    header_bytes = HEADERS_KEPT.get(qtype)
    values_a_block, bytes_a_block = gguf.GGML_QUANT_SIZES[Q(qtype)]

    def headers_of(data: torch.Tensor) -> torch.Tensor:  # a slice of rows' super-block headers
        return data.reshape(-1, cols // values_a_block, bytes_a_block)[..., :header_bytes]

    if getattr(raw, "ndim", 1) != 2 or raw.shape[0] != rows:  # not in rows: read at once
        data = _as_u8(raw)
        q, scales, offsets = read(data)
        q, scales = q.reshape(rows, cols), scales.reshape(rows, cols // 32)
        offsets = offsets.reshape(rows, cols // 32) if offsets is not None else None
        headers = headers_of(data).contiguous() if header_bytes else None
    else:  # a file's rows, a slice at a time: no copy of the whole tensor's bytes beside its integers
        q = torch.empty(rows, cols, dtype=torch.int8)
        scales, offsets = torch.empty(rows, cols // 32), None
        headers = torch.empty(rows, cols // values_a_block, header_bytes, dtype=torch.uint8) if header_bytes else None
        for start in range(0, rows, _INTEGER_ROWS):
            data = _as_u8(raw[start:start + _INTEGER_ROWS])
            part_q, part_scales, part_offsets = read(data)
            n = part_q.numel() // cols
            q[start:start + n] = part_q.view(n, cols)
            scales[start:start + n] = part_scales.view(n, -1)
            if part_offsets is not None:
                offsets = torch.empty(rows, cols // 32) if offsets is None else offsets
                offsets[start:start + n] = part_offsets.view(n, -1)
            if headers is not None:
                headers[start:start + n] = headers_of(data)
            if decoded is not None:
                decoded(start, start + n)
    return IntegerWeight(format=type_name(qtype), source_name=source_name, bits=bits, block=32,
                         q=q, scales=scales, offsets=offsets, headers=headers)


# rows of a tensor in a file that integer_weight decodes at once
_INTEGER_ROWS = 4096


def _f32(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float32).clone()


def _f16_all(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float16).float()


def _bf16(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.bfloat16).float()


DEQUANTIZERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    F32: _f32,
    F16: _f16_all,
    BF16: _bf16,
    Q8_0: dequantize_q8_0,
    Q4_0: dequantize_q4_0,
    Q4_1: dequantize_q4_1,
    Q5_0: dequantize_q5_0,
    Q5_1: dequantize_q5_1,
    Q4_K: dequantize_q4_k,
    Q5_K: dequantize_q5_k,
    Q6_K: dequantize_q6_k,
}

SUPPORTED = tuple(Q(t).name for t in DEQUANTIZERS)
"""The types dequantized here, in torch (the fast path)."""


def dequantize(raw, qtype: int, shape=None) -> torch.Tensor:
    """Float32 values of a GGML tensor from its raw bytes, reshaped to `shape` if given.

    `shape` is in PyTorch order (rows first), i.e. GGUF's dims reversed. Types without a
    dequantizer here go through ``gguf.quants.dequantize`` (warned once per type);
    :class:`NotImplementedError` names a type that neither can read.
    """
    qtype = int(qtype)
    fn = DEQUANTIZERS.get(qtype)
    out = fn(_as_u8(raw)) if fn is not None else _dequantize_with_gguf(raw, qtype)
    return out.reshape(tuple(shape)) if shape is not None else out


def _dequantize_with_gguf(raw, qtype: int) -> torch.Tensor:
    """The slow path: ``gguf.quants.dequantize`` (numpy), for the types missing here."""
    from gguf import quants as gguf_quants

    name = type_name(qtype)
    sizes = {int(t): size for t, size in gguf.GGML_QUANT_SIZES.items()}
    if qtype not in sizes:
        raise NotImplementedError(f"GGML tensor type {name} is unknown to the gguf package")
    data = _as_u8(raw).numpy()
    if data.size % sizes[qtype][1]:
        raise ValueError(f"{data.size} bytes is not a whole number of {sizes[qtype][1]}-byte blocks")
    try:
        values = gguf_quants.dequantize(data, Q(qtype))
    except NotImplementedError:
        raise NotImplementedError(
            f"GGML tensor type {name} is not supported (the llama plugin reads {', '.join(SUPPORTED)}; "
            f"gguf.quants cannot dequantize {name} either)"
        ) from None
    if qtype not in _warned:
        _warned.add(qtype)
        log.warning("GGUF tensors of type %s are dequantized by gguf.quants, the slow path (numpy)", name)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(-1))


def type_name(qtype: int) -> str:
    try:
        return Q(int(qtype)).name
    except ValueError:
        return f"type id {int(qtype)}"
