"""Cheap checks that recognise checkpoint formats (no torch import, small reads only)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Optional

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
                weight_map = json.loads(index.read_text())["weight_map"]
            except Exception:
                return None
            return config, [folder / f for f in sorted(set(weight_map.values()))]
        files = sorted(folder.glob(pattern))
        if files:
            return config, files
    return None


def is_hf(path: Path) -> bool:
    return hf_files(path) is not None


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
