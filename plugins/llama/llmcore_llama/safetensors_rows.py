"""A safetensors file's tensors read a few rows at a time, with positioned reads, not a mapping.

Why not the ``safetensors`` package's reader: it maps the file, and every page a read
touches then counts in the process's resident memory for as long as the mapping lives. A
loader that leaves a bf16 checkpoint's weights in the file (:class:`llmcore.stored.FileWeight`)
so that a recipe reads them one layer at a time would get the whole file back in its peak
that way. Here each read is an ``os.preadv`` of the rows' bytes into a buffer of their own:
the kernel's page cache keeps the file, the process holds only what it asked for.

The format (the safetensors specification): an 8-byte little-endian header length, a JSON
header mapping each tensor name to its ``dtype``, ``shape`` and ``data_offsets`` (a byte range
relative to the end of the header), then the data, row-major and little-endian.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
"""The element types read here (those of float checkpoints)."""

_HEADER_LIMIT = 100 * 1024 * 1024  # the specification's bound on the header


class SafetensorsLayoutError(ValueError):
    """The file is not laid out as the safetensors format says (truncated, damaged)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    """Absolute byte offset of the tensor's first element in the file."""

    @property
    def row_bytes(self) -> int:
        return prod(self.shape[1:]) * FLOAT_DTYPES[self.dtype].itemsize


class SafetensorsRows:
    """The tensors of one safetensors file, by name (:attr:`entries`), read by rows."""

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SafetensorsLayoutError(f"{self.path} is shorter than a safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(_HEADER_LIMIT, size - 8):
                raise SafetensorsLayoutError(f"{self.path}: header length {length} does not fit the file")
            try:
                header = json.loads(f.read(length))
            except ValueError as e:
                raise SafetensorsLayoutError(f"{self.path}: the header is not JSON ({e})") from None
        base = 8 + length
        self.entries: dict[str, TensorEntry] = {}
        self.other: dict[str, dict] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            if base + end > size or end < begin:
                raise SafetensorsLayoutError(f"{self.path}: tensor {name!r} lies beyond the end of the file")
            if dtype not in FLOAT_DTYPES:
                self.other[name] = info
                continue
            if end - begin != prod(shape) * FLOAT_DTYPES[dtype].itemsize:
                raise SafetensorsLayoutError(f"{self.path}: tensor {name!r} has {end - begin} bytes for shape {list(shape)}")
            self.entries[name] = TensorEntry(name, dtype, shape, base + begin)

    def read(self, name: str, rows: slice = slice(None)) -> torch.Tensor:
        """Rows ``rows`` (a plain slice of the first dimension) of tensor ``name``, in its dtype."""
        entry = self.entries[name]
        first, stop, step = rows.indices(entry.shape[0])
        if step != 1:
            raise ValueError(f"{name}: rows are read by a plain slice")
        count = max(0, stop - first)
        buffer = torch.empty(count * entry.row_bytes, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        offset, done = entry.start + first * entry.row_bytes, 0
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while done < len(view):
                n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise SafetensorsLayoutError(f"{self.path}: tensor {name!r} is cut short")
                done += n
        finally:
            os.close(fd)
        return buffer.view(FLOAT_DTYPES[entry.dtype]).view(count, *entry.shape[1:])
