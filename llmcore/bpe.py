"""Byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM2 style) as ``tokenizer.json`` text.

Model families convert what their checkpoints ship (``vocab.json`` + ``merges.txt``, a
GGUF's vocabulary, tiktoken ranks) into this one form. The JSON is written by the
``tokenizers`` library from its own objects (``models.BPE``, ``pre_tokenizers.ByteLevel``,
``decoders.ByteLevel``), so it is exactly what Hugging Face tooling writes and reads.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Mapping, Optional, Sequence, Union


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, the alphabet of
    byte-level BPE vocabularies (``"Ġ"`` is the space byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_level_bpe_json(
    vocab: Mapping[str, int],
    merges: Iterable[Union[str, Sequence[str]]],
    added_tokens: Iterable[tuple[str, bool]] = (),
    *,
    pattern: Optional[str] = None,
    individual_digits: bool = False,
) -> str:
    """A byte-level BPE ``tokenizer.json``.

    ``vocab`` maps tokens (in the :func:`bytes_to_unicode` alphabet) to ids; ``merges`` are
    ranked pairs, ``"a b"`` or ``(a, b)``. ``added_tokens`` are ``(content, special)``
    pairs of tokens of ``vocab`` matched in the raw text before pre-tokenization (special
    ones are skipped when decoding with ``skip_special_tokens``). The pre-tokenizer is
    GPT-2's ByteLevel regex, with digits split one by one first when
    ``individual_digits`` (SmolLM2), or a split on ``pattern`` (Llama 3, Qwen2) followed by
    a ByteLevel without its own regex. Nothing is added around a text (no BOS).

    Raises ``ValueError`` when the merges or added tokens name a token ``vocab`` lacks.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]
    try:
        tokenizer = Tokenizer(models.BPE(vocab=dict(vocab), merges=pairs))
    except Exception as exc:  # tokenizers raises a bare Exception for a merge out of vocabulary
        raise ValueError(f"the BPE merges do not fit the vocabulary: {exc}") from None
    if pattern is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif individual_digits:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    for content, special in added_tokens:
        if content not in vocab:
            raise ValueError(f"added token {content!r} is not in the vocabulary")
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
    return tokenizer.to_str(pretty=True)  # as Tokenizer.save writes a tokenizer.json
