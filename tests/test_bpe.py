"""llmcore.bpe writes byte-level BPE tokenizer.json through the tokenizers library, and its
output tokenizes exactly as the hand-written JSON the model families wrote before."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from llmcore.bpe import byte_level_bpe_json, bytes_to_unicode

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "Once upon a time there was a little cat that liked to play in the garden with her friends.",
    "The capital of France is Paris; 2024 was a leap year, and 1234 + 5678 = 6912.",
    "café naïve über 東京 données, don't can't I'M ready!!  two  spaces\nnew line\ttab",
] * 20
TEXTS = [
    "Hello world 12345!",
    "  two  spaces\n\nnew  lines\t tab",
    "café naïve 東京 données <|im_start|>user\nhi<|im_end|>",
    "don't I'M 3.14159 <|endoftext|>the end",
]

# The JSON the nanogpt and llama plugins wrote by hand before llmcore.bpe, as the reference.
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
OLD_PRE = {
    "gpt2": BYTE_LEVEL,
    "smollm2": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL]},
    "llama3": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
        {**BYTE_LEVEL, "use_regex": False}]},
}
NEW_OPTIONS = {"gpt2": {}, "smollm2": {"individual_digits": True}, "llama3": {"pattern": LLAMA3_PATTERN}}
SPECIALS = {"gpt2": ["<|endoftext|>"], "smollm2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            "llama3": ["<|begin_of_text|>", "<|eot_id|>"]}


def _old_json(vocab: dict, merges: list, specials: list[str], pre: dict) -> str:
    flags = dict(single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
    added = [dict(id=vocab[t], content=t, **flags) for t in specials]
    model = dict(type="BPE", dropout=None, unk_token=None, continuing_subword_prefix=None, end_of_word_suffix=None,
                 fuse_unk=False, byte_fallback=False, ignore_merges=False, vocab=vocab,
                 merges=[" ".join(m) for m in merges])
    return json.dumps(dict(version="1.0", truncation=None, padding=None, added_tokens=added, normalizer=None,
                           pre_tokenizer=pre, post_processor=None, decoder=BYTE_LEVEL, model=model))


def _trained(specials: list[str]) -> tuple[dict, list]:
    """A small byte-level vocabulary (256 bytes, specials, ~300 merges) trained on CORPUS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    doc = json.loads(tok.to_str())
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in doc["model"]["merges"]]
    return doc["model"]["vocab"], merges


@pytest.mark.parametrize("style", ["gpt2", "smollm2", "llama3"])
def test_tokenizes_as_the_old_hand_written_json(style):
    vocab, merges = _trained(SPECIALS[style])
    old = Tokenizer.from_str(_old_json(vocab, merges, SPECIALS[style], OLD_PRE[style]))
    text = byte_level_bpe_json(vocab, merges, [(t, True) for t in SPECIALS[style]], **NEW_OPTIONS[style])
    new = Tokenizer.from_str(text)
    assert new.get_vocab() == old.get_vocab()
    for sample in TEXTS:
        ids = old.encode(sample).ids
        assert new.encode(sample).ids == ids, (style, sample)
        assert new.decode(ids, skip_special_tokens=False) == old.decode(ids, skip_special_tokens=False)
        assert new.decode(ids) == old.decode(ids)
    assert Tokenizer.from_str(text).to_str(pretty=True) == text  # what tokenizers itself writes


def test_merges_may_be_strings_and_non_special_tokens_are_kept():
    vocab, merges = _trained(["<|endoftext|>", "<tool>"])
    text = byte_level_bpe_json(vocab, [" ".join(m) for m in merges], [("<|endoftext|>", True), ("<tool>", False)])
    tok = Tokenizer.from_str(text)
    ids = tok.encode("a<tool>b<|endoftext|>").ids
    assert vocab["<tool>"] in ids and vocab["<|endoftext|>"] in ids
    assert tok.decode(ids) == "a<tool>b"  # special tokens are skipped, the others are text


def test_refuses_merges_and_added_tokens_outside_the_vocabulary():
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    with pytest.raises(ValueError, match="merges do not fit"):
        byte_level_bpe_json(vocab, [("a", "zz")])
    with pytest.raises(ValueError, match="not in the vocabulary"):
        byte_level_bpe_json(vocab, [], [("<|endoftext|>", True)])


def test_bytes_to_unicode_is_gpt2_s_alphabet():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256 and table[ord(" ")] == "Ġ" and table[ord("A")] == "A"
    assert sorted(table.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())


def whole_text_so_far(decode, ids: list[int]) -> str:
    """What a reply shows after ``ids`` when each step decodes all ids again: the text of the
    longest prefix that does not end inside a character (llmcore's way before ``stream``)."""
    for k in range(len(ids), -1, -1):
        text = decode(ids[:k], skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            return text
    return ""


@pytest.mark.parametrize("style", ["smollm2", "llama3"])
def test_streamed_text_is_the_whole_decode(style):
    """``TextTokenizer.stream`` (the reply as `llmcore run` prints it and `llmcore serve`
    sends it) writes, after every id, what decoding every id so far gives: with special
    tokens skipped, multi-byte characters split over ids held back, random ids included."""
    import random

    from llmcore.runtime.generate import TextTokenizer

    vocab, merges = _trained(SPECIALS[style])
    text = byte_level_bpe_json(vocab, merges, [(t, True) for t in SPECIALS[style]], **NEW_OPTIONS[style])
    tok, reference = TextTokenizer(text), Tokenizer.from_str(text)
    rng = random.Random(0)
    replies = [reference.encode(sample).ids for sample in TEXTS]
    replies += [[rng.randrange(len(vocab)) for _ in range(40)] for _ in range(20)]
    for ids in replies:
        text_of, shown = tok.stream(), ""
        for n, token in enumerate(ids, 1):
            shown += text_of(token)
            assert shown == whole_text_so_far(reference.decode, ids[:n]), (style, ids[:n])
