"""llama2.c checkpoints (legacy header and version 1)."""

from dataclasses import replace

import pytest
import torch

from llama_testutils import TINY, random_model, tokens, train_sentencepiece
from llmcore.errors import LlmcoreError
from llmcore.records import LoadOptions
from llmcore_llama import LOADERS, formats, loaders


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("tied", [True, False], ids=["shared", "separate-classifier"])
def test_round_trip(tmp_path, version, tied):
    cfg = replace(TINY, tie_embeddings=tied)
    model = random_model(cfg)
    path = tmp_path / "stories.bin"
    loaders.write_llama2c(model, path, version=version)
    h = formats.llama2c_header(path)
    assert h is not None and h["version"] == version and h["shared_classifier"] == tied
    if version == 0:  # legacy: a negative vocab_size marks the separate classifier
        import struct

        assert (struct.unpack("<7i", path.read_bytes()[:28])[5] < 0) == (not tied)
    llama2c = next(l for l in LOADERS if l.name == "llama2c")
    assert llama2c.matches(path) and not any(l.matches(path) for l in LOADERS if l.name != "llama2c")
    lm = llama2c.load(path, LoadOptions())
    toks = tokens(12, cfg.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(lm.module(toks), model(toks), atol=0, rtol=0)
    for k, v in model.state_dict().items():
        assert torch.equal(lm.module.state_dict()[k], v), k
    assert lm.metadata.max_seq_len == cfg.max_seq_len and lm.metadata.vocab_size == cfg.vocab_size


def test_truncated_file_is_not_matched(tmp_path):
    path = tmp_path / "model.bin"
    loaders.write_llama2c(random_model(), path)
    path.write_bytes(path.read_bytes()[:-4])
    assert not formats.is_llama2c(path)
    with pytest.raises(LlmcoreError):
        loaders.load_llama2c(path, LoadOptions())


def test_tokenizer_model_next_to_checkpoint(tmp_path):
    sp_path = train_sentencepiece(tmp_path / "tokenizer.model")
    import sentencepiece as spm

    n = spm.SentencePieceProcessor(model_file=str(sp_path)).vocab_size()
    cfg = replace(TINY, vocab_size=n)
    loaders.write_llama2c(random_model(cfg), tmp_path / "model.bin")
    lm = loaders.load_llama2c(tmp_path / "model.bin", LoadOptions())
    assert lm.tokenizer is not None and lm.metadata.bos_id == 1 and lm.metadata.n_bos == 1


def test_explicit_tokenizer_that_does_not_fit_is_refused(tmp_path):
    from llmcore_llama.tokenization import tiny_tokenizer

    cfg = replace(TINY, vocab_size=100)
    loaders.write_llama2c(random_model(cfg), tmp_path / "model.bin")
    (tmp_path / "other" ).mkdir()
    tok = tmp_path / "other" / "tokenizer.json"
    tok.write_text(tiny_tokenizer().json_text)
    with pytest.raises(LlmcoreError) as e:
        loaders.load_llama2c(tmp_path / "model.bin", LoadOptions(tokenizer_path=tok))
    assert "320 tokens" in e.value.message
