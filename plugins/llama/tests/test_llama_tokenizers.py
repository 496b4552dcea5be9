"""Tokenizer conversions: SentencePiece, tiktoken, tokenizer.json as is, the tiny tokenizer."""

import json

import pytest

from llama_testutils import SAMPLE_TEXTS, corpus_lines, train_sentencepiece, write_tiktoken
from llmcore_llama.tokenization import (
    TokenizerError,
    bytes_to_unicode,
    load_tokenizer_file,
    tiny_tokenizer,
)

tokenizers = pytest.importorskip("tokenizers")


def hf(info):
    return tokenizers.Tokenizer.from_str(info.json_text)


def streamed(info, ids) -> str:
    """The reply as llmcore prints it while generating: one id at a time."""
    from llmcore.runtime.generate import TextTokenizer

    text_of = TextTokenizer(info.json_text).stream()
    return "".join(text_of(token) for token in ids)


def test_bytes_to_unicode_is_a_bijection_onto_printables():
    m = bytes_to_unicode()
    assert len(set(m.values())) == 256
    assert m[ord("A")] == "A" and m[ord(" ")] == "\u0120" and m[ord("\n")] == "\u010a"


@pytest.mark.parametrize(
    "kind,kwargs",
    [
        ("llama2-bpe", {}),
        ("nfkc-bpe-no-fallback", dict(model_type="bpe", byte_fallback=False, normalization_rule_name="nmt_nfkc",
                                      remove_extra_whitespaces=True, allow_whitespace_only_pieces=False, vocab_size=300,
                                      character_coverage=1.0)),
        ("unigram", dict(model_type="unigram", vocab_size=400)),
    ],
)
def test_sentencepiece_conversion_encodes_like_sentencepiece(tmp_path, kind, kwargs):
    import sentencepiece as spm

    path = train_sentencepiece(tmp_path / "tokenizer.model", **kwargs)
    sp = spm.SentencePieceProcessor(model_file=str(path))
    info = load_tokenizer_file(path)
    tk = hf(info)
    assert info.bos_id == 1 and info.eos_ids[0] == 2 and info.n_bos == 1 and info.size == sp.vocab_size()
    for text in SAMPLE_TEXTS + corpus_lines(200, seed=1):
        ids = sp.encode(text)
        assert tk.encode(text, add_special_tokens=False).ids == ids, text
        if kwargs.get("byte_fallback", True):
            assert tk.decode(ids) == sp.decode(ids), text
            assert streamed(info, ids) == sp.decode(ids), text  # "▁" made a space, but not the first


def test_tiktoken_conversion_encodes_like_tiktoken(tmp_path):
    from pytorch_tokenizers import TiktokenTokenizer

    path = write_tiktoken(tmp_path / "tokenizer.model")
    ref = TiktokenTokenizer(str(path))  # Llama 3 regex and special tokens
    info = load_tokenizer_file(path)
    tk = hf(info)
    assert info.size == ref.n_words and info.bos_id == ref.bos_id and info.eos_ids[0] == ref.eos_id
    assert info.n_bos == 1 and len(info.eos_ids) == 3  # end_of_text, eom, eot
    texts = SAMPLE_TEXTS + corpus_lines(200, seed=2) + ["<|begin_of_text|>hi<|eot_id|>"]
    for text in texts:
        ids = ref.encode(text, bos=False, eos=False, allowed_special="all")
        assert tk.encode(text, add_special_tokens=False).ids == ids, text
        assert tk.decode(ids, skip_special_tokens=False) == text
        assert streamed(info, ids) == tk.decode(ids, skip_special_tokens=True)


def test_tokenizer_json_used_as_is(tmp_path):
    tok = tiny_tokenizer()
    doc = json.loads(tok.json_text)
    doc["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
        "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [317], "tokens": ["<|begin_of_text|>"]}},
    }
    text = json.dumps(doc)
    (tmp_path / "tokenizer.json").write_text(text)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|end_of_text|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [318, 319]}))
    info = load_tokenizer_file(tmp_path)  # a folder works too
    assert info.json_text == text
    assert info.bos_id == 317 and info.n_bos == 1  # read from the TemplateProcessing
    assert info.eos_ids == (318, 319)


def test_tiny_tokenizer_round_trips():
    info = tiny_tokenizer(320)
    tk = hf(info)
    assert tk.get_vocab_size() == 320 == info.size
    assert (info.bos_id, info.eos_ids, info.n_bos) == (317, (318, 319), 1)
    for text in SAMPLE_TEXTS + ["<|begin_of_text|>The capital of France is Paris.<|eot_id|>"]:
        ids = tk.encode(text, add_special_tokens=False).ids
        assert max(ids, default=0) < 320
        assert tk.decode(ids, skip_special_tokens=False) == text
    assert tiny_tokenizer(320).json_text == info.json_text  # deterministic


def test_unreadable_tokenizer_is_an_error(tmp_path):
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"\x00\x01 not a model")
    with pytest.raises(TokenizerError):
        load_tokenizer_file(bad)
    with pytest.raises(TokenizerError):
        load_tokenizer_file(tmp_path / "missing.json")
