"""Tokenizers in Hugging Face ``tokenizer.json`` form, built from what checkpoints ship.

Byte-level BPE vocabularies are written by :mod:`llmcore.bpe` (through the ``tokenizers``
library's own objects); the SentencePiece conversion writes its JSON by hand. Sources:

* a GGUF's embedded vocabulary: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE,
  with the pre-tokenizer named by ``tokenizer.ggml.pre``) or ``"llama"`` (SentencePiece);
* a SentencePiece ``.model`` (Llama 2 style BPE with byte fallback is exact; see
  :func:`sentencepiece_to_json`);
* a tiktoken ranks file (Llama 3's ``tokenizer.model``), with Llama 3's special tokens
  and split regex;
* a ``tokenizer.json``, used as is (its ``tokenizer_config.json`` neighbour, when present,
  supplies BOS/EOS and the chat template).

The JSON these functions generate never adds BOS itself (no post-processor): how many BOS
tokens to put first is :attr:`TokenizerInfo.n_bos`, which the ``.pte`` carries.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

from llmcore import nesting
from llmcore.bpe import byte_level_bpe_json, bytes_to_unicode
from llmcore.errors import LlmcoreError

# --------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Special tokens that end a turn or a document in common Llama-family vocabularies.
END_TOKENS = (
    "</s>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<end_of_turn>",
    "<|end|>",
)

SPIECE_UNDERLINE = "\u2581"

# SentencePiece / GGUF token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass
class TokenizerInfo:
    """A ``tokenizer.json`` text plus the facts the runner metadata needs."""

    json_text: str
    bos_id: int = -1
    eos_ids: tuple[int, ...] = ()
    add_bos: bool = False
    chat_template: Optional[str] = None
    description: str = ""
    size: int = 0
    """Number of token ids the tokenizer can produce (model vocab may be larger)."""

    @property
    def n_bos(self) -> int:
        return 1 if self.add_bos and self.bos_id >= 0 else 0


class TokenizerError(ValueError):
    """A tokenizer could not be converted; loaders turn it into an LlmcoreError."""


def _added_token(tok_id: int, content: str, special: bool = True) -> dict:
    return {
        "id": tok_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def _merges_field(merges: Iterable) -> list:
    """Merges as ``"a b"`` strings when no side contains a space, else ``[a, b]`` pairs."""
    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]
    if any(" " in a or " " in b for a, b in pairs):
        return [list(p) for p in pairs]
    return [f"{a} {b}" for a, b in pairs]


def end_token_ids(tokens_by_id: Mapping[int, str], eos_id: int = -1, extra: Iterable[int] = ()) -> tuple[int, ...]:
    """`eos_id` first, then every other known end-of-turn token the vocabulary has."""
    ids: list[int] = []
    for i in [eos_id, *extra]:
        if i is not None and i >= 0 and i not in ids:
            ids.append(int(i))
    by_content = {c: i for i, c in tokens_by_id.items()}
    for name in END_TOKENS:
        i = by_content.get(name)
        if i is not None and i not in ids:
            ids.append(i)
    return tuple(ids)


# --------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------

#: tokenizer.ggml.pre -> (split regex or None for GPT-2's, digits split individually)
GGUF_PRE_TOKENIZERS: dict[str, tuple[Optional[str], bool]] = {
    "default": (None, False),
    "gpt-2": (None, False),
    "gpt2": (None, False),
    "smollm": (None, True),
    "starcoder": (None, True),
    "refact": (None, True),
    "codeshell": (None, True),
    "llama-bpe": (LLAMA3_PATTERN, False),
    "llama3": (LLAMA3_PATTERN, False),
    "smaug-bpe": (LLAMA3_PATTERN, False),
    "dbrx": (LLAMA3_PATTERN, False),
    "qwen2": (QWEN2_PATTERN, False),
}


def _gguf_list(value, key: str, kind: type, length: Optional[int] = None) -> list:
    """A GGUF array field as a list of ``kind`` (of ``length`` items), or a TokenizerError."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TokenizerError(f"the GGUF's {key} is a {type(value).__name__}, not an array")
    if length is not None and len(value) != length:
        raise TokenizerError(f"the GGUF's {key} has {len(value)} entries for {length} tokens")
    ok = (lambda v: isinstance(v, str)) if kind is str else (
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or float(v).is_integer())
    )
    bad = next((v for v in value if not ok(v)), None)
    if bad is not None or (kind is float and any(v != v for v in value)):
        raise TokenizerError(f"the GGUF's {key} holds {str(bad)[:40]!r}, not {'text' if kind is str else 'a number'}")
    return [kind(v) for v in value]


def _gguf_id(value, key: str, n_tokens: int) -> Optional[int]:
    """A token id field (None when absent), checked against the vocabulary's size."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TokenizerError(f"the GGUF's {key} is {str(value)[:40]!r}, not a token id")
    if not -1 <= value < n_tokens:
        raise TokenizerError(f"the GGUF's {key} is {value}, outside the {n_tokens}-token vocabulary")
    return value


def tokenizer_from_gguf_fields(get) -> TokenizerInfo:
    """Build a tokenizer from GGUF metadata. ``get(key, default=None)`` reads one field.
    Malformed metadata is a :class:`TokenizerError`."""
    try:
        return _tokenizer_from_gguf_fields(get)
    except TokenizerError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
        raise TokenizerError(f"the GGUF's embedded tokenizer is malformed: {type(e).__name__}: {str(e)[:160]}") from None


def _tokenizer_from_gguf_fields(get) -> TokenizerInfo:
    model = get("tokenizer.ggml.model")
    tokens = get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise TokenizerError("the GGUF file has no embedded tokenizer (tokenizer.ggml.model / tokens)")
    tokens = _gguf_list(tokens, "tokenizer.ggml.tokens", str)
    n = len(tokens)
    types = _gguf_list(get("tokenizer.ggml.token_type") or [NORMAL] * n, "tokenizer.ggml.token_type", int, n)
    bos = _gguf_id(get("tokenizer.ggml.bos_token_id"), "tokenizer.ggml.bos_token_id", n)
    eos = _gguf_id(get("tokenizer.ggml.eos_token_id"), "tokenizer.ggml.eos_token_id", n)
    extra_eos = [_gguf_id(get(k), k, n) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    chat_template = get("tokenizer.chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise TokenizerError(f"the GGUF's tokenizer.chat_template is a {type(chat_template).__name__}, not text")
    tokens_by_id = {i: t for i, t in enumerate(tokens)}

    if model == "gpt2":
        pre = get("tokenizer.ggml.pre") or "default"
        if pre not in GGUF_PRE_TOKENIZERS:
            raise TokenizerError(
                f"GGUF pre-tokenizer {pre!r} is not known to the llama plugin "
                f"(known: {', '.join(sorted(GGUF_PRE_TOKENIZERS))})"
            )
        merges = get("tokenizer.ggml.merges")
        if merges is None:
            raise TokenizerError("the GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
        merges = _gguf_list(merges, "tokenizer.ggml.merges", str)
        bad = next((m for m in merges if len(m.split(" ")) != 2), None)
        if bad is not None:
            raise TokenizerError(f"the GGUF's tokenizer.ggml.merges holds {bad[:40]!r}, not two tokens joined by a space")
        pattern, digits = GGUF_PRE_TOKENIZERS[pre]
        added = [(t, ty == CONTROL) for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
        vocab = {t: i for i, t in enumerate(tokens)}
        text = byte_level_bpe_json(vocab, [str(m) for m in merges], added, pattern=pattern, individual_digits=digits)
        add_bos = bool(get("tokenizer.ggml.add_bos_token", False))
        desc = f"byte-level BPE from GGUF (pre-tokenizer {pre!r}, {len(tokens)} tokens)"
    elif model == "llama":
        scores = _gguf_list(get("tokenizer.ggml.scores") or [0.0] * n, "tokenizer.ggml.scores", float, n)
        unk = _gguf_id(get("tokenizer.ggml.unknown_token_id", 0), "tokenizer.ggml.unknown_token_id", n)
        text = sentencepiece_to_json(
            tokens,
            scores,
            types,
            model_type="bpe",
            unk_id=unk if unk is not None else 0,
            add_dummy_prefix=bool(get("tokenizer.ggml.add_space_prefix", True)),
            byte_fallback=BYTE in types,
        )
        add_bos = bool(get("tokenizer.ggml.add_bos_token", True))
        desc = f"SentencePiece BPE from GGUF ({len(tokens)} tokens)"
    else:
        raise TokenizerError(f"GGUF tokenizer model {model!r} is not supported (supported: gpt2, llama)")

    return TokenizerInfo(
        json_text=text,
        bos_id=int(bos) if bos is not None else -1,
        eos_ids=end_token_ids(tokens_by_id, -1 if eos is None else int(eos), [e for e in extra_eos if e is not None]),
        add_bos=add_bos,
        chat_template=str(chat_template) if chat_template else None,
        description=desc,
        size=len(tokens),
    )


# --------------------------------------------------------------------------------------
# SentencePiece
# --------------------------------------------------------------------------------------


def _spm_merges(pieces: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-ordered merging.

    Every normal piece that splits into two normal pieces yields a merge; merges are
    ranked by the merged piece's score (highest first), ties by the parts' ranks.
    """
    rank = {}
    for i, (p, ty) in enumerate(zip(pieces, types)):
        if ty in (NORMAL, USER_DEFINED) and p not in rank:
            rank[p] = i
    order = {p: k for k, p in enumerate(sorted(rank, key=lambda p: (-scores[rank[p]], rank[p])))}
    merges = []
    for piece in rank:
        if types[rank[piece]] != NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in order and right in order:
                merges.append((order[piece], order[left], order[right], left, right))
    merges.sort()
    return [(m[3], m[4]) for m in merges]


def sentencepiece_to_json(
    pieces: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    *,
    model_type: str = "bpe",
    unk_id: int = 0,
    add_dummy_prefix: bool = True,
    byte_fallback: bool = True,
    remove_extra_whitespaces: bool = False,
    precompiled_charsmap: bytes = b"",
) -> str:
    """A ``tokenizer.json`` equivalent to a SentencePiece model.

    Exact for Llama-2-style models (BPE, byte fallback, identity normalisation, no
    whitespace collapsing). Unigram models use the ``tokenizers`` Unigram model; models
    with an NFKC-style normaliser get it through the ``Precompiled`` normaliser, which the
    Python ``tokenizers`` package understands but ExecuTorch's C++ tokenizer does not.
    """
    if not (len(pieces) == len(scores) == len(types)):
        raise TokenizerError("SentencePiece pieces, scores and types differ in length")
    normalizers: list[dict] = []
    if precompiled_charsmap:
        normalizers.append(
            {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(precompiled_charsmap).decode()}
        )
    if remove_extra_whitespaces:
        normalizers.append({"type": "Strip", "strip_left": True, "strip_right": True})
        normalizers.append({"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "})
    if add_dummy_prefix:
        normalizers.append({"type": "Prepend", "prepend": SPIECE_UNDERLINE})
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": SPIECE_UNDERLINE})

    decoders: list[dict] = [{"type": "Replace", "pattern": {"String": SPIECE_UNDERLINE}, "content": " "}]
    if byte_fallback:
        decoders.append({"type": "ByteFallback"})
    decoders.append({"type": "Fuse"})
    if add_dummy_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})

    unk_piece = pieces[unk_id] if 0 <= unk_id < len(pieces) else None
    if model_type == "bpe":
        vocab = {}
        for i, p in enumerate(pieces):
            vocab.setdefault(p, i)
        model = {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk_piece,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": byte_fallback,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": _merges_field(_spm_merges(pieces, scores, types)),
        }
    elif model_type == "unigram":
        model = {
            "type": "Unigram",
            "unk_id": unk_id,
            "vocab": [[p, float(s)] for p, s in zip(pieces, scores)],
            "byte_fallback": byte_fallback,
        }
    else:
        raise TokenizerError(f"SentencePiece model type {model_type!r} is not supported (supported: bpe, unigram)")

    # Control and user-defined tokens are matched in the raw text, as HF's (legacy) Llama
    # tokenizer does. Two known differences from SentencePiece itself: SentencePiece never
    # matches control tokens such as "<s>" in text, and the text right after a
    # user-defined symbol gets its own dummy-prefix "▁".
    added = [
        _added_token(i, p, special=(ty in (CONTROL, UNKNOWN)))
        for i, (p, ty) in enumerate(zip(pieces, types))
        if ty in (CONTROL, UNKNOWN, USER_DEFINED)
    ]
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": model,
    }
    return json.dumps(doc, ensure_ascii=False)


def sentencepiece_model_info(path: Path) -> TokenizerInfo:
    """Convert a SentencePiece ``.model`` file (needs the ``sentencepiece`` package)."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise TokenizerError(f"reading a SentencePiece model needs the sentencepiece and protobuf packages ({e})")
    proto = pb.ModelProto()
    try:
        proto.ParseFromString(Path(path).read_bytes())
    except Exception as e:
        raise TokenizerError(f"{path} is not a SentencePiece model ({e})")
    if not proto.pieces:
        raise TokenizerError(f"{path} is not a SentencePiece model (no pieces)")
    pieces = [p.piece for p in proto.pieces]
    scores = [p.score for p in proto.pieces]
    types = [int(p.type) for p in proto.pieces]
    ts, ns = proto.trainer_spec, proto.normalizer_spec
    model_type = {1: "unigram", 2: "bpe"}.get(int(ts.model_type))
    if model_type is None:
        raise TokenizerError(f"SentencePiece model type {pb.TrainerSpec.ModelType.Name(ts.model_type)} is not supported")
    identity = ns.name in ("identity", "") or not ns.precompiled_charsmap
    text = sentencepiece_to_json(
        pieces,
        scores,
        types,
        model_type=model_type,
        unk_id=ts.unk_id,
        add_dummy_prefix=ns.add_dummy_prefix,
        byte_fallback=ts.byte_fallback,
        remove_extra_whitespaces=ns.remove_extra_whitespaces,
        precompiled_charsmap=b"" if identity else ns.precompiled_charsmap,
    )
    by_id = dict(enumerate(pieces))
    bos = ts.bos_id if 0 <= ts.bos_id < len(pieces) else -1
    eos = ts.eos_id if 0 <= ts.eos_id < len(pieces) else -1
    return TokenizerInfo(
        json_text=text,
        bos_id=bos,
        eos_ids=end_token_ids(by_id, eos),
        add_bos=bos >= 0,
        description=f"SentencePiece {model_type} ({len(pieces)} pieces, normaliser {ns.name or 'identity'}) converted to tokenizer.json",
        size=len(pieces),
    )


# --------------------------------------------------------------------------------------
# tiktoken (Llama 3)
# --------------------------------------------------------------------------------------


def llama3_special_tokens(n_reserved: int = 256) -> list[str]:
    """Llama 3's special tokens, in id order after the base vocabulary."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
        "<|image|>",
    ]
    return named + [f"<|reserved_special_token_{2 + i}|>" for i in range(n_reserved - len(named))]


_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=*\s+\d+\s*$")


def looks_like_tiktoken(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return False
    return bool(_TIKTOKEN_LINE.match(first))


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except Exception:
            raise TokenizerError(f"{path}:{n} is not a tiktoken 'base64 rank' line")
    return ranks


def tiktoken_to_json(
    ranks: Mapping[bytes, int],
    special_tokens: Sequence[str],
    pattern: str = LLAMA3_PATTERN,
) -> str:
    """A byte-level BPE ``tokenizer.json`` equivalent to a tiktoken encoding.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank, so every
    split of a token into two tokens becomes a merge ranked by the token's rank.
    """
    enc = bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab = {to_str(b): r for b, r in ranks.items()}
    merges = []
    for token, r in ranks.items():
        if len(token) < 2:
            continue
        local = []
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                local.append((r, ranks[left], ranks[right], to_str(left), to_str(right)))
        merges.extend(local)
    merges.sort()
    base = max(ranks.values()) + 1 if ranks else 0
    for i, t in enumerate(special_tokens):
        vocab[t] = base + i
    return byte_level_bpe_json(vocab, [(m[3], m[4]) for m in merges], [(t, True) for t in special_tokens], pattern=pattern)


def tiktoken_file_info(path: Path) -> TokenizerInfo:
    ranks = read_tiktoken_ranks(path)
    specials = llama3_special_tokens()
    text = tiktoken_to_json(ranks, specials)
    base = max(ranks.values()) + 1
    by_id = {base + i: t for i, t in enumerate(specials)}
    return TokenizerInfo(
        json_text=text,
        bos_id=base,  # <|begin_of_text|>
        eos_ids=end_token_ids(by_id, base + 1),
        add_bos=True,
        description=f"tiktoken ranks ({len(ranks)} tokens) with Llama 3 special tokens, converted to tokenizer.json",
        size=base + len(specials),
    )


# --------------------------------------------------------------------------------------
# tokenizer.json as is
# --------------------------------------------------------------------------------------


def _token_content(tok) -> Optional[str]:
    if isinstance(tok, str):
        return tok
    if isinstance(tok, dict):
        return tok.get("content")
    return None


def _adds_bos(post_processor: Optional[dict], bos_id: int) -> Optional[bool]:
    """Whether a post-processor puts `bos_id` first; None when it cannot tell."""
    if not post_processor:
        return None
    kind = post_processor.get("type")
    if kind == "Sequence":
        found = [_adds_bos(p, bos_id) for p in post_processor.get("processors", [])]
        return True if True in found else (False if False in found else None)
    if kind == "TemplateProcessing":
        single = post_processor.get("single") or []
        if not single or "SpecialToken" not in single[0]:
            return False
        name = single[0]["SpecialToken"].get("id")
        ids = (post_processor.get("special_tokens", {}).get(name) or {}).get("ids") or []
        return bool(ids) and ids[0] == bos_id
    return False


def _neighbour(path: Path, name: str) -> dict:
    """The JSON object in the file ``name`` next to ``path``, or {} when there is none or it
    cannot be read (it only adds facts); one nested past llmcore's limit is refused by name."""
    found = path.with_name(name)
    if not found.is_file():
        return {}
    try:
        data = nesting.loads(found.read_text(encoding="utf-8"), what=str(found), plugin="llama")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def tokenizer_json_info(path: Path) -> TokenizerInfo:
    """A ``tokenizer.json`` used verbatim; BOS/EOS from it and its HF neighbours."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        doc = nesting.loads(text, what=str(path), plugin="llama")
        vocab = doc["model"]["vocab"]
    except LlmcoreError:
        raise
    except Exception as e:
        raise TokenizerError(f"{path} is not a Hugging Face tokenizer.json ({e})")
    by_id: dict[int, str] = {}
    if isinstance(vocab, dict):
        by_id.update({int(i): t for t, i in vocab.items()})
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        by_id.update({i: p[0] for i, p in enumerate(vocab)})
    for t in doc.get("added_tokens") or []:
        by_id[int(t["id"])] = t["content"]
    ids_by_token = {t: i for i, t in by_id.items()}

    config = _neighbour(path, "tokenizer_config.json")
    gen = _neighbour(path, "generation_config.json")

    bos_tok = _token_content(config.get("bos_token"))
    bos = ids_by_token.get(bos_tok, -1) if bos_tok else -1
    if bos < 0 and isinstance(gen.get("bos_token_id"), int):
        bos = gen["bos_token_id"]
    if bos < 0:
        for name in ("<|begin_of_text|>", "<s>"):
            if name in ids_by_token:
                bos = ids_by_token[name]
                break
    eos_tok = _token_content(config.get("eos_token"))
    eos = ids_by_token.get(eos_tok, -1) if eos_tok else -1
    gen_eos = gen.get("eos_token_id")
    extra = gen_eos if isinstance(gen_eos, list) else ([gen_eos] if isinstance(gen_eos, int) else [])
    add_bos = _adds_bos(doc.get("post_processor"), bos)
    if add_bos is None:
        add_bos = bool(config.get("add_bos_token", False))
    chat_template = config.get("chat_template")
    if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, ...]
        default = [t for t in chat_template if isinstance(t, dict) and t.get("name") == "default"]
        chat_template = (default or chat_template)[0].get("template") if chat_template else None
    return TokenizerInfo(
        json_text=text,
        bos_id=bos,
        eos_ids=end_token_ids(by_id, eos, extra),
        add_bos=bool(add_bos),
        chat_template=chat_template if isinstance(chat_template, str) else None,
        description=f"tokenizer.json from {path}",
        size=(max(by_id) + 1) if by_id else 0,
    )


# --------------------------------------------------------------------------------------
# Dispatch on a file
# --------------------------------------------------------------------------------------


def load_tokenizer_file(path: Path) -> TokenizerInfo:
    """``tokenizer.json`` (as is), a SentencePiece ``.model`` or a tiktoken ranks file.

    A folder is searched for ``tokenizer.json``, then ``tokenizer.model``. Whatever is
    wrong with the file is a :class:`TokenizerError`.
    """
    try:
        return _load_tokenizer_file(Path(path))
    except TokenizerError:
        raise
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"cannot read tokenizer {path}: {getattr(e, 'strerror', None) or e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RecursionError) as e:
        raise TokenizerError(f"{path} is not a usable tokenizer: {type(e).__name__}: {str(e)[:160]}") from None


def _load_tokenizer_file(path: Path) -> TokenizerInfo:
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).is_file():
                return _load_tokenizer_file(path / name)
        raise TokenizerError(f"no tokenizer.json or tokenizer.model in {path}")
    if not path.is_file():
        raise TokenizerError(f"tokenizer file {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    if head.startswith(b"{"):
        return tokenizer_json_info(path)
    if looks_like_tiktoken(path):
        return tiktoken_file_info(path)
    return sentencepiece_model_info(path)


def find_tokenizer_near(folder: Path) -> Optional[Path]:
    """The tokenizer a checkpoint folder ships, if any."""
    for name in ("tokenizer.json", "tokenizer.model"):
        if (folder / name).is_file():
            return folder / name
    return None


# --------------------------------------------------------------------------------------
# The tiny random-model tokenizer
# --------------------------------------------------------------------------------------

_TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model reads a short story about
the sea, the sun and the rain. Once upon a time there was a little cat that liked to
play in the garden with her friends. They ran, they laughed and then they went home.
What is the capital of France? The capital of France is Paris. Tell me a story please.
"""

TINY_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")


def _train_byte_bpe(text: str, n_merges: int) -> list[tuple[bytes, bytes]]:
    """A deterministic toy byte-pair trainer (most frequent pair, ties by byte order)."""
    words: dict[tuple[bytes, ...], int] = {}
    for w in re.findall(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+", text):
        key = tuple(bytes([b]) for b in w.encode("utf-8"))
        words[key] = words.get(key, 0) + 1
    merges = []
    for _ in range(n_merges):
        counts: dict[tuple[bytes, bytes], int] = {}
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + c
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        new_words = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + c
        words = new_words
    return merges


def tiny_tokenizer(vocab_size: int = 320) -> TokenizerInfo:
    """A byte-level BPE with exactly `vocab_size` ids for the random `tiny` config:
    256 byte tokens, ``vocab_size - 259`` merges, then BOS, EOS and EOT."""
    n_merges = vocab_size - 256 - len(TINY_SPECIAL_TOKENS)
    if n_merges < 0:
        raise TokenizerError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer")
    enc = bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab = {to_str(bytes([b])): b for b in range(256)}
    merges = []
    for a, b in _train_byte_bpe(_TINY_CORPUS * 4, n_merges + 32):
        if len(vocab) == 256 + n_merges:
            break
        merges.append((a, b))
        vocab.setdefault(to_str(a + b), len(vocab))
    if len(vocab) != 256 + n_merges:
        raise TokenizerError(f"the toy corpus cannot fill a {vocab_size}-token vocabulary")
    first_special = len(vocab)
    for i, t in enumerate(TINY_SPECIAL_TOKENS):
        vocab[t] = first_special + i
    text = byte_level_bpe_json(
        vocab, [(to_str(a), to_str(b)) for a, b in merges], [(t, True) for t in TINY_SPECIAL_TOKENS]
    )
    return TokenizerInfo(
        json_text=text,
        bos_id=first_special,
        eos_ids=(first_special + 1, first_special + 2),
        add_bos=True,
        description=f"toy byte-level BPE ({len(vocab)} tokens) for random models",
        size=len(vocab),
    )
