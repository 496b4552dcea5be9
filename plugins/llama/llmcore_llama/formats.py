"""Cheap checks that recognise checkpoint formats (no torch import, small reads only)."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from llmcore import nesting
from llmcore.errors import LlmcoreError

GGUF_MAGIC = b"GGUF"
LLAMA2C_V1_MAGIC = 0x616B3432  # "ak42", llama2.c export format versions >= 1


def _read(path: Path, n: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return b""


def is_gguf(path: Path) -> bool:
    path = Path(path)
    return path.is_file() and _read(path, 4) == GGUF_MAGIC


def gguf_architecture(path: Path) -> Optional[str]:
    """A GGUF file's ``general.architecture`` (``llama``, ``qwen2``, ...), or None when
    ``path`` is not a readable GGUF file.

    Read by walking the header up to that key (it comes first in llama.cpp's files), not
    with ``gguf.GGUFReader``, which parses every key and tensor info (seconds for
    SmolLM2-135M's, whose vocabulary is 49k strings; docs/performance.md, "Measurements
    behind the code"): each family's loader asks this when an export leaves out
    ``--model``.
    """
    if not is_gguf(path):
        return None
    import mmap

    try:
        with open(Path(path), "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _GGUFWalker(data, len(data)).string_value("general.architecture")
    except (GGUFLayoutError, OSError, ValueError):  # a damaged file: the loader that reads it says what is wrong
        return None


def meta_files(path: Path) -> Optional[tuple[Path, list[Path]]]:
    """(params.json, consolidated shards) of a Meta checkpoint folder or shard file."""
    path = Path(path)
    if path.is_dir():
        params = path / "params.json"
        shards = sorted(path.glob("consolidated.*.pth"))
        if not shards:
            shards = sorted(p for p in path.glob("*.pth") if p.is_file())
        return (params, shards) if params.is_file() and shards else None
    if path.is_file() and path.suffix in (".pth", ".pt"):
        params = path.with_name("params.json")
        if params.is_file():
            return params, [path]
    return None


def is_meta(path: Path) -> bool:
    return meta_files(path) is not None


def hf_files(path: Path) -> Optional[tuple[Path, list[Path]]]:
    """(config.json, weight files) of a Hugging Face checkpoint folder or file.

    Safetensors are preferred; ``pytorch_model*.bin`` pickles are used only when a folder
    has no safetensors (and are read with ``weights_only``)."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    config = folder / "config.json"
    if not config.is_file():
        return None
    if path.is_file():
        return (config, [path]) if path.suffix == ".safetensors" or path.name.startswith("pytorch_model") else None
    for index_name, pattern in (("model.safetensors.index.json", "*.safetensors"), ("pytorch_model.bin.index.json", "pytorch_model*.bin")):
        index = folder / index_name
        if index.is_file():
            try:
                weight_map = nesting.loads(index.read_text(), what=str(index), plugin="llama")["weight_map"]
            except LlmcoreError:
                raise
            except Exception:
                return None
            return config, [folder / f for f in sorted(set(weight_map.values()))]
        files = sorted(folder.glob(pattern))
        if files:
            return config, files
    return None


def is_hf(path: Path) -> bool:
    return hf_files(path) is not None


def hf_architecture(path: Path) -> Optional[str]:
    """The ``model_type`` a Hugging Face checkpoint's config.json names (``llama``,
    ``qwen2``, ...), or None when ``path`` is not one or its config cannot be read."""
    found = hf_files(path)
    if found is None:
        return None
    try:
        model_type = nesting.loads(found[0].read_text(), what=str(found[0]), plugin="llama").get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if isinstance(model_type, str) else None


def llama2c_header(path: Path) -> Optional[dict]:
    """Parse a llama2.c checkpoint header; None when `path` is not one.

    Legacy format: 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
    seq_len; negative vocab_size = separate classifier) then fp32 weights. Version 1:
    uint32 magic "ak42", int32 version, the 7 int32, uint8 shared_classifier, padded to
    256 bytes.
    """
    path = Path(path)
    if not path.is_file():
        return None
    head = _read(path, 256)
    if len(head) < 28:
        return None
    size = path.stat().st_size
    magic = struct.unpack("<I", head[:4])[0]
    if magic == LLAMA2C_V1_MAGIC:
        if len(head) < 37:
            return None
        version = struct.unpack("<i", head[4:8])[0]
        dim, hidden, n_layers, n_heads, n_kv, vocab, seq = struct.unpack("<7i", head[8:36])
        shared = bool(head[36])
        offset = 256
    else:
        version = 0
        dim, hidden, n_layers, n_heads, n_kv, vocab, seq = struct.unpack("<7i", head[:28])
        shared = vocab > 0
        vocab = abs(vocab)
        offset = 28
    if min(dim, hidden, n_layers, n_heads, n_kv, vocab, seq) <= 0 or dim % n_heads or n_heads % n_kv:
        return None
    if max(dim, hidden, n_heads, seq) > 1 << 20 or n_layers > 1024 or vocab > 1 << 22:
        return None
    head_dim = dim // n_heads
    kv_dim = n_kv * head_dim
    n = (
        vocab * dim
        + n_layers * (2 * dim + dim * dim * 2 + 2 * dim * kv_dim + 3 * dim * hidden)
        + dim
        + (0 if shared else vocab * dim)
    )
    if version == 0:
        n += seq * head_dim  # freqs_cos and freqs_sin, seq x head_dim/2 each
    expected = offset + 4 * n if version in (0, 1) else None
    if version in (0, 1) and size != expected:
        return None
    return {
        "version": version,
        "dim": dim,
        "hidden_dim": hidden,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv,
        "vocab_size": vocab,
        "max_seq_len": seq,
        "shared_classifier": shared,
        "offset": offset,
    }


def is_llama2c(path: Path) -> bool:
    return llama2c_header(path) is not None



# GGUF value types (gguf.GGUFValueType): struct formats of the scalars; 8 = STRING, 9 = ARRAY.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
GGUF_MAX_DIMS = 4
GGUF_MAX_NESTING = 4


class GGUFLayoutError(ValueError):
    """A GGUF whose header does not describe a file of its size and shape."""

    def __init__(self, message: str, truncated: bool = False):
        super().__init__(message)
        self.truncated = truncated


@dataclass
class GGUFTensorInfo:
    """A tensor as a GGUF's header lists it: ``dims`` in the file's order (the row length
    first), ``data_offset`` from the start of the file."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    data_offset: int


@dataclass
class GGUFHeader:
    """A GGUF's key/values and tensor infos. Values are as the file stores them: numbers and
    bools as Python's, strings as ``bytes`` (decoded by whoever reads a key, so that a
    malformed string fails only the key that is read), arrays as lists."""

    fields: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    byte_order: str
    """``<`` or ``>``: how the file's numbers, tensor data included, are stored."""


def read_gguf_header(path: Path, block_sizes: dict) -> GGUFHeader:
    """Walk a GGUF's header (key/values, tensor infos), checking every count, length and
    tensor extent against the file's size, and keep what it holds.

    A reader that trusts the header can loop for ever on an array length flipped to 2**60
    or fail deep inside on a truncated file; this turns both into one clear
    :class:`GGUFLayoutError` first, as it does a duplicated key or tensor name.
    ``block_sizes`` maps ggml type ids to (values per block, bytes per block): tensor types
    must be among them and the tensor data must lie inside the file.

    Read here rather than with ``gguf.GGUFReader``: the reader makes a numpy view of the file
    per string of the vocabulary and merges (SmolLM2-135M has 49k of each), many times
    slower than this walk (docs/performance.md, "Measurements behind the code").
    ``plugins/llama/tests/test_gguf_header.py`` holds it to the reader's answers."""
    import mmap

    with open(Path(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise GGUFLayoutError(f"it has {size} bytes, fewer than a GGUF header", truncated=True)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _GGUFWalker(data, size, keep=True).walk(block_sizes)


class _GGUFWalker:
    """Reads a GGUF header front to back, checking each length against the file's size
    before reading it; ``keep``: keep every value (else only scalars are returned)."""

    def __init__(self, data, size: int, keep: bool = False):
        self.data, self.size, self.pos, self.order, self.keep = data, size, 0, "<", keep

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise GGUFLayoutError(
                f"{what} (at byte {self.pos}) would need {n} bytes, but the file ends at byte {self.size}",
                truncated=True,
            )

    def read(self, fmt: str, what: str) -> tuple:
        n = struct.calcsize(self.order + fmt)
        self.need(n, what)
        values = struct.unpack_from(self.order + fmt, self.data, self.pos)
        self.pos += n
        return values

    def string(self, what: str) -> bytes:
        (length,) = self.read("Q", what)
        self.need(length, what)
        text = self.data[self.pos : self.pos + length]
        self.pos += length
        return text

    def value(self, vtype: int, key: str, depth: int = 0):
        """One value: returned when it is a scalar or the walker keeps values, else skipped."""
        if vtype in _GGUF_SCALARS:
            return self.read(_GGUF_SCALARS[vtype], f"the value of {key!r}")[0]
        if vtype == _GGUF_STRING:
            text = self.string(f"the value of {key!r}")
            return text if self.keep else None
        if vtype != _GGUF_ARRAY:
            raise GGUFLayoutError(f"key {key!r} has an unknown value type {vtype}")
        if depth >= GGUF_MAX_NESTING:
            raise GGUFLayoutError(f"key {key!r} nests arrays more than {GGUF_MAX_NESTING} deep")
        itype, length = self.read("IQ", f"the array header of {key!r}")
        if itype in _GGUF_SCALARS:
            fmt = f"{self.order}{length}{_GGUF_SCALARS[itype]}"
            n = length * struct.calcsize(_GGUF_SCALARS[itype])
            self.need(n, f"the {length} values of {key!r}")
            values = list(struct.unpack_from(fmt, self.data, self.pos)) if self.keep else None
            self.pos += n
            return values
        smallest = 8 if itype == _GGUF_STRING else 12
        self.need(length * smallest, f"the {length} values of {key!r}")
        if self.keep:
            return [self.value(itype, key, depth + 1) for _ in range(length)]
        for _ in range(length):
            self.value(itype, key, depth + 1)
        return None

    def header(self) -> tuple[int, int]:
        """Check the magic and version; ``(tensor_count, kv_count)``, the key/values next."""
        if self.data[:4] != GGUF_MAGIC:
            raise GGUFLayoutError("it has no GGUF magic")
        (version,) = struct.unpack_from("<I", self.data, 4)
        if version & 0xFFFF == 0:  # written on a big-endian machine
            self.order = ">"
            (version,) = struct.unpack_from(">I", self.data, 4)
        if version not in (2, 3):
            raise GGUFLayoutError(f"it is GGUF version {version}, which is not supported (2 and 3 are)")
        self.pos = 8
        tensor_count, kv_count = self.read("QQ", "the tensor and key/value counts")
        # a key/value takes at least 13 bytes, a tensor info at least 24
        if kv_count * 13 + tensor_count * 24 > self.size - self.pos:
            raise GGUFLayoutError(
                f"its header claims {kv_count} key/values and {tensor_count} tensors, more than its "
                f"{self.size} bytes can hold",
                truncated=True,
            )
        return tensor_count, kv_count

    def string_value(self, wanted: str) -> Optional[str]:
        """The string value of key ``wanted``, walking the key/values only as far as it."""
        _, kv_count = self.header()
        for _ in range(kv_count):
            key = self.string("a key").decode("utf-8", "replace")
            (vtype,) = self.read("I", f"the type of {key[:80]!r}")
            if key == wanted and vtype == _GGUF_STRING:
                return self.string(f"the value of {wanted!r}").decode("utf-8", "replace")
            self.value(vtype, key[:80])
        return None

    def walk(self, block_sizes: dict) -> GGUFHeader:
        """The whole header (the walker keeps values), its tensor extents checked."""
        tensor_count, kv_count = self.header()
        alignment = 32
        fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self.string("a key").decode("utf-8", "replace")
            (vtype,) = self.read("I", f"the type of {key[:80]!r}")
            value = self.value(vtype, key[:80])
            if key == "general.alignment":
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value & (value - 1):
                    raise GGUFLayoutError(f"general.alignment {value!r} is not a power of two")
                alignment = value
            if key in fields:
                raise GGUFLayoutError(f"it lists the key {key[:80]!r} twice")
            fields[key] = value
        tensors = []
        for _ in range(tensor_count):
            name = self.string("a tensor name").decode("utf-8", "replace")
            (n_dims,) = self.read("I", f"the rank of tensor {name[:80]!r}")
            if n_dims > GGUF_MAX_DIMS:
                raise GGUFLayoutError(f"tensor {name[:80]!r} claims {n_dims} dimensions (GGUF allows {GGUF_MAX_DIMS})")
            dims = self.read(f"{n_dims}Q", f"the shape of tensor {name[:80]!r}")
            ggml_type, offset = self.read("IQ", f"the type and offset of tensor {name[:80]!r}")
            tensors.append((name, dims, ggml_type, offset))
        start = self.pos + (-self.pos) % alignment
        self.check_extents(tensors, start, block_sizes)
        infos: dict[str, GGUFTensorInfo] = {}
        for name, dims, ggml_type, offset in tensors:
            if name in infos:
                raise GGUFLayoutError(f"it lists the tensor {name[:80]!r} twice")
            infos[name] = GGUFTensorInfo(name, tuple(dims), ggml_type, start + offset)
        return GGUFHeader(fields, list(infos.values()), self.order)

    def check_extents(self, tensors: list, start: int, block_sizes: dict) -> None:
        for name, dims, ggml_type, offset in tensors:
            name = name[:80]
            if ggml_type not in block_sizes:
                raise GGUFLayoutError(f"tensor {name!r} has an unknown ggml type id {ggml_type}")
            per_block, block_bytes = block_sizes[ggml_type]
            count = 1
            for d in dims:
                count *= d
            if dims and dims[0] % per_block:
                raise GGUFLayoutError(f"tensor {name!r} has rows of {dims[0]} values, not whole {per_block}-value blocks")
            end = start + offset + count // per_block * block_bytes
            if end > self.size:
                raise GGUFLayoutError(
                    f"the data of tensor {name!r} ends at byte {end}, but the file ends at byte {self.size}",
                    truncated=True,
                )
