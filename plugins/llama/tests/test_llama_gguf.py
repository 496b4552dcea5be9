"""GGUF: dequantizers against gguf's, files written with GGUFWriter, embedded tokenizers."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from llama_testutils import (
    SAMPLE_TEXTS,
    TINY,
    meta_state_dict,
    random_k_blocks,
    random_model,
    reference_forward,
    tokens,
    train_sentencepiece,
    write_gguf,
)
from llmcore.errors import LlmcoreError
from llmcore.records import LoadOptions
from llmcore_llama import formats, loaders, quants
from llmcore_llama.tokenization import TINY_SPECIAL_TOKENS, tiny_tokenizer

# a shape whose rows are multiples of 256, so K-quants fit
WIDE = replace(TINY, dim=256, n_heads=4, n_kv_heads=2, hidden_dim=512, max_seq_len=32)


@pytest.mark.parametrize("qt", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_dequantizers_agree_with_gguf(qt):
    rows, cols = 6, 512
    if qt in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        raw = random_k_blocks(qt, rows, cols, seed=int(qt))
    else:
        rng = np.random.default_rng(int(qt))
        raw = gq.quantize((rng.standard_normal((rows, cols)) * 0.3).astype(np.float32), qt)
    ref = gq.dequantize(raw, qt)
    mine = quants.dequantize(raw, int(qt), (rows, cols))
    assert mine.dtype == torch.float32 and mine.shape == (rows, cols)
    assert np.array_equal(mine.numpy(), ref.astype(np.float32)), qt.name  # bit-exact


def test_unsupported_type_names_it():
    # Q8_K (llama.cpp's intermediate type): neither the plugin nor gguf.quants dequantizes it
    with pytest.raises(NotImplementedError, match="Q8_K"):
        quants.dequantize(np.zeros(292, np.uint8), int(Q.Q8_K))


def test_block_sizes_are_gguf_s():
    import gguf

    assert not hasattr(quants, "BLOCK")  # no private table beside gguf.GGML_QUANT_SIZES
    rows = np.zeros((3, gguf.GGML_QUANT_SIZES[Q.Q3_K][1] + 1), np.uint8)
    with pytest.raises(ValueError, match="110-byte blocks"):
        quants.dequantize(rows, int(Q.Q3_K))


def test_f32_gguf_gives_the_same_logits_as_meta(tmp_path):
    model = random_model(TINY)
    sd = meta_state_dict(model)
    write_gguf(tmp_path / "m.gguf", sd, TINY)
    lm = loaders.load_gguf(tmp_path / "m.gguf", LoadOptions())
    toks = tokens(10, TINY.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(lm.module(toks), model(toks), atol=1e-6, rtol=0)
    assert lm.module.config.tie_embeddings is False
    assert lm.tokenizer is None and lm.metadata.max_seq_len == TINY.max_seq_len


def test_quantized_gguf_loads_its_dequantized_weights(tmp_path):
    model = random_model(WIDE, std=0.05)
    sd = meta_state_dict(model)
    types = {
        "tok_embeddings.weight": Q.Q8_0,
        "layers.0.attention.wq.weight": Q.F16,
        "layers.0.attention.wk.weight": Q.BF16,
        "layers.0.attention.wv.weight": Q.Q4_0,
        "layers.0.attention.wo.weight": Q.Q4_1,
        "layers.0.feed_forward.w1.weight": Q.Q5_0,
        "layers.0.feed_forward.w3.weight": Q.Q5_1,
        "layers.1.attention.wv.weight": Q.Q8_0,
        "layers.1.attention.wo.weight": Q.Q8_0,
        "layers.1.feed_forward.w1.weight": Q.Q4_0,
        "layers.1.feed_forward.w2.weight": Q.Q4_1,
        "layers.1.feed_forward.w3.weight": Q.F16,
    }
    raw = {
        "layers.0.feed_forward.w2.weight": (Q.Q6_K, random_k_blocks(Q.Q6_K, 256, 512, seed=1)),
        "layers.1.attention.wq.weight": (Q.Q4_K, random_k_blocks(Q.Q4_K, 256, 256, seed=2)),
        "layers.1.attention.wk.weight": (Q.Q5_K, random_k_blocks(Q.Q5_K, 128, 256, seed=3)),
        "output.weight": (Q.Q6_K, random_k_blocks(Q.Q6_K, 320, 256, seed=4)),
    }
    stored = write_gguf(tmp_path / "q.gguf", sd, WIDE, types=types, raw=raw)
    assert {t for t, _ in stored.values()} >= {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K}

    lm = loaders.load_gguf(tmp_path / "q.gguf", LoadOptions())
    loaded = lm.module.state_dict()
    from llama_testutils import gguf_name

    expected = {}
    for name in sd:
        qt, data = stored[gguf_name(name)]
        deq = torch.from_numpy(np.ascontiguousarray(gq.dequantize(data, qt)).astype(np.float32))
        expected[name] = deq.reshape(sd[name].shape)
        assert torch.equal(loaded[name], expected[name]), (name, qt.name)
    toks = tokens(9, WIDE.vocab_size)
    ref = reference_forward(expected, WIDE, toks)
    # The weights are bit-equal above; the forward passes differ only by float32 summation
    # order, which on the AVX2-only EPYC moved one logit of 320 by 1.8e-4 in a CI run (with
    # the pytest worker's one thread) and not in others: 1e-3 still catches a wrong weight.
    with torch.no_grad():
        torch.testing.assert_close(lm.module(toks)[0], ref[-1], atol=1e-3, rtol=1e-3)


def test_rejects_other_architectures(tmp_path):
    write_gguf(tmp_path / "g.gguf", meta_state_dict(random_model()), TINY, arch="gpt2")
    with pytest.raises(LlmcoreError) as e:
        loaders.load_gguf(tmp_path / "g.gguf", LoadOptions())
    assert "'gpt2'" in e.value.message and "not llama" in e.value.message
    assert e.value.stage == "load" and e.value.plugin == "llama"


def test_rejects_unsupported_tensor_types_by_name(tmp_path):
    sd = meta_state_dict(random_model(WIDE, std=0.05))
    raw = {"layers.0.feed_forward.w2.weight": (Q.Q8_K, np.zeros((256, 512 // 256 * 292), np.uint8))}
    write_gguf(tmp_path / "q8k.gguf", sd, WIDE, raw=raw)
    with pytest.raises(LlmcoreError) as e:
        loaders.load_gguf(tmp_path / "q8k.gguf", LoadOptions())
    assert "Q8_K" in e.value.message and "blk.0.ffn_down.weight" in e.value.message


def test_types_without_a_fast_dequantizer_go_through_gguf(tmp_path, monkeypatch, caplog):
    """Q2_K and Q3_K: gguf.quants cannot write them, so the blocks are random but well-formed
    bytes (random quants, small float16 scales) written with GGUFWriter as those types; the
    loader must give exactly what gguf.quants.dequantize reads from them, warning once a type."""
    monkeypatch.setattr(quants, "_warned", set())
    sd = meta_state_dict(random_model(WIDE, std=0.05))
    raw = {
        "layers.0.feed_forward.w2.weight": (Q.Q2_K, random_k_blocks(Q.Q2_K, 256, 512, seed=5)),
        "layers.1.feed_forward.w2.weight": (Q.Q2_K, random_k_blocks(Q.Q2_K, 256, 512, seed=6)),
        "layers.0.attention.wq.weight": (Q.Q3_K, random_k_blocks(Q.Q3_K, 256, 256, seed=7)),
    }
    stored = write_gguf(tmp_path / "k.gguf", sd, WIDE, raw=raw)
    with caplog.at_level("WARNING", logger=quants.__name__):
        loaded = loaders.load_gguf(tmp_path / "k.gguf", LoadOptions()).module.state_dict()
    from llama_testutils import gguf_name

    for name, (qt, _) in raw.items():
        stored_qt, data = stored[gguf_name(name)]
        assert stored_qt == qt
        expected = np.ascontiguousarray(gq.dequantize(data, qt), dtype=np.float32).reshape(sd[name].shape)
        assert np.array_equal(loaded[name].numpy(), expected), name
    warnings = [r.getMessage() for r in caplog.records if r.name == quants.__name__]
    assert len(warnings) == 2 and all("slow path" in w for w in warnings)
    assert any("Q2_K" in w for w in warnings) and any("Q3_K" in w for w in warnings)


def _gpt2_tokenizer_fields(pre="smollm"):
    info = tiny_tokenizer(320)
    doc = json.loads(info.json_text)
    by_id = sorted(doc["model"]["vocab"].items(), key=lambda kv: kv[1])
    toks = [t for t, _ in by_id]
    types = [3 if t in TINY_SPECIAL_TOKENS else 1 for t in toks]
    return info, {
        "model": "gpt2",
        "pre": pre,
        "tokens": toks,
        "types": types,
        "merges": [m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]],  # GGUF: "a b"
        "bos": 317,
        "eos": 319,
        "add_bos": True,
        "chat_template": "{{ messages[0]['content'] }}",
    }


def test_gpt2_tokenizer_from_gguf(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    src, fields = _gpt2_tokenizer_fields(pre="gpt-2")
    write_gguf(tmp_path / "t.gguf", meta_state_dict(random_model()), TINY, tokenizer=fields)
    lm = loaders.load_gguf(tmp_path / "t.gguf", LoadOptions())
    got = tokenizers.Tokenizer.from_str(lm.tokenizer.json_text)
    ref = tokenizers.Tokenizer.from_str(src.json_text)
    for text in SAMPLE_TEXTS + ["<|begin_of_text|>The capital of France is Paris.<|eot_id|> 2024"]:
        ids = got.encode(text, add_special_tokens=False).ids
        assert ids == ref.encode(text, add_special_tokens=False).ids
        assert got.decode(ids, skip_special_tokens=False) == text
    md = lm.metadata
    assert md.bos_id == 317 and md.n_bos == 1 and md.eos_ids[0] == 319 and 318 in md.eos_ids
    assert md.chat_template == "{{ messages[0]['content'] }}"


def test_smollm_pre_tokenizer_splits_digits(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    _, fields = _gpt2_tokenizer_fields(pre="smollm")
    write_gguf(tmp_path / "t.gguf", meta_state_dict(random_model()), TINY, tokenizer=fields)
    tk = tokenizers.Tokenizer.from_str(loaders.load_gguf(tmp_path / "t.gguf", LoadOptions()).tokenizer.json_text)
    pieces = [p for p, _ in tk.pre_tokenizer.pre_tokenize_str("Year 2024, it's")]
    assert pieces == ["Year", "Ġ", "2", "0", "2", "4", ",", "Ġit", "'s"]
    for text in SAMPLE_TEXTS:
        assert tk.decode(tk.encode(text, add_special_tokens=False).ids) == text


def test_unknown_pre_tokenizer_is_a_clear_error(tmp_path):
    _, fields = _gpt2_tokenizer_fields(pre="mystery-bpe")
    write_gguf(tmp_path / "t.gguf", meta_state_dict(random_model()), TINY, tokenizer=fields)
    with pytest.raises(LlmcoreError) as e:
        loaders.load_gguf(tmp_path / "t.gguf", LoadOptions())
    assert "mystery-bpe" in e.value.message and "--tokenizer" in e.value.fix
    # ... which --tokenizer works around
    tok = tmp_path / "tokenizer.json"
    tok.write_text(tiny_tokenizer().json_text)
    lm = loaders.load_gguf(tmp_path / "t.gguf", LoadOptions(tokenizer_path=tok))
    assert lm.tokenizer.json_text == tiny_tokenizer().json_text
    assert lm.metadata.chat_template == "{{ messages[0]['content'] }}"  # kept from the GGUF


def test_sentencepiece_tokenizer_from_gguf(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    path = train_sentencepiece(tmp_path / "sp.model")
    proto = pb.ModelProto()
    proto.ParseFromString(path.read_bytes())
    sp = spm.SentencePieceProcessor(model_file=str(path))
    fields = {
        "model": "llama",
        "tokens": [p.piece for p in proto.pieces],
        "scores": [p.score for p in proto.pieces],
        "types": [int(p.type) for p in proto.pieces],
        "bos": 1,
        "eos": 2,
        "add_bos": True,
    }
    cfg = replace(TINY, vocab_size=len(proto.pieces))
    write_gguf(tmp_path / "s.gguf", meta_state_dict(random_model(cfg)), cfg, tokenizer=fields)
    lm = loaders.load_gguf(tmp_path / "s.gguf", LoadOptions())
    tk = tokenizers.Tokenizer.from_str(lm.tokenizer.json_text)
    for text in SAMPLE_TEXTS:
        assert tk.encode(text, add_special_tokens=False).ids == sp.encode(text), text
    assert lm.metadata.bos_id == 1 and lm.metadata.n_bos == 1 and lm.metadata.eos_ids == (2,)


def test_gguf_matches_only_gguf(tmp_path):
    write_gguf(tmp_path / "m.gguf", meta_state_dict(random_model()), TINY)
    assert formats.is_gguf(tmp_path / "m.gguf")
    (tmp_path / "x.gguf").write_bytes(b"nope")
    assert not formats.is_gguf(tmp_path / "x.gguf")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_architecture_reads_what_gguf_reads(tmp_path, arch):
    """The header walk that families claim GGUFs with gives gguf.GGUFReader's answer; a
    file cut inside its header gives None (its loader then says what is wrong)."""
    from gguf import GGUFReader

    path = tmp_path / "m.gguf"
    write_gguf(path, meta_state_dict(random_model()), TINY, arch=arch)
    assert formats.gguf_architecture(path) == GGUFReader(str(path)).get_field("general.architecture").contents() == arch
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:30])
    assert formats.gguf_architecture(cut) is None
