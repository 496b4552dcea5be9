"""Meta (.pth + params.json) and Hugging Face (safetensors) loaders."""

import json
import os
import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from llama_testutils import (
    TINY,
    hf_reference_forward,
    meta_state_dict,
    random_model,
    reference_forward,
    tokens,
    write_hf,
    write_meta,
)
from llmcore.errors import LlmcoreError
from llmcore.records import LoadOptions
from llmcore_llama import LOADERS, loaders
from llmcore_llama.tokenization import tiny_tokenizer

ATOL = 1e-5


def logits(lm, toks):
    """Last-position logits of a LoadedModel or a bare module."""
    with torch.no_grad():
        return getattr(lm, "module", lm)(toks)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_matches_meta_layout(tmp_path, tied):
    cfg = replace(TINY, tie_embeddings=tied)
    model = random_model(cfg)
    sd = meta_state_dict(model)
    hf = write_hf(tmp_path / "hf", sd, cfg)
    write_meta(tmp_path / "meta", sd, cfg)
    toks = tokens(11, cfg.vocab_size)

    from_hf = loaders.load_hf(tmp_path / "hf", LoadOptions())
    from_meta = loaders.load_meta(tmp_path / "meta", LoadOptions())
    a, b = logits(from_hf, toks), logits(from_meta, toks)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    torch.testing.assert_close(a, logits(model, toks), atol=ATOL, rtol=0)
    # and against HF's own math (rotate_half RoPE) run directly on the HF-layout weights
    ref = hf_reference_forward(hf, json.loads((tmp_path / "hf" / "config.json").read_text()), toks)
    torch.testing.assert_close(a[0], ref[-1], atol=ATOL, rtol=0)
    assert from_hf.module.config.tie_embeddings == tied
    assert from_hf.metadata.vocab_size == cfg.vocab_size and from_hf.metadata.max_seq_len == cfg.max_seq_len


def test_hf_permutation_matters(tmp_path):
    """Sanity check of the test itself: loading HF weights without undoing the rotary
    permutation gives clearly different logits."""
    model = random_model()
    sd = meta_state_dict(model)
    hf = write_hf(tmp_path / "hf", sd, TINY)
    wrong = dict(sd)
    for i in range(TINY.n_layers):
        wrong[f"layers.{i}.attention.wq.weight"] = hf[f"model.layers.{i}.self_attn.q_proj.weight"]
        wrong[f"layers.{i}.attention.wk.weight"] = hf[f"model.layers.{i}.self_attn.k_proj.weight"]
    toks = tokens(11, TINY.vocab_size)
    good = reference_forward(sd, TINY, toks)[-1]
    bad = reference_forward(wrong, TINY, toks)[-1]
    assert (good - bad).abs().max() > 1e-2


def test_hf_sharded_with_tokenizer_and_rope_scaling(tmp_path):
    cfg = replace(TINY, rope_theta=500000.0)
    model = random_model(cfg)
    sd = meta_state_dict(model)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    write_hf(tmp_path, sd, cfg, shards=3, extra_config={"rope_scaling": scaling})
    tok = tiny_tokenizer(320)
    (tmp_path / "tokenizer.json").write_text(tok.json_text)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }))
    lm = loaders.load_hf(tmp_path, LoadOptions())
    assert lm.module.config.rope_scaling is not None and lm.module.config.rope_scaling.factor == 8.0
    from llmcore_llama.model import rope_inv_freq

    toks = tokens(9, 320)
    ref = reference_forward(sd, cfg, toks, inv_freq=rope_inv_freq(lm.module.config))
    torch.testing.assert_close(logits(lm, toks)[0], ref[-1], atol=ATOL, rtol=0)
    md = lm.metadata
    assert md.bos_id == 317 and md.eos_ids[0] == 319 and 318 in md.eos_ids and md.n_bos == 1
    assert md.chat_template.startswith("{% for m in messages %}")
    assert lm.tokenizer.json_text == tok.json_text  # used as is


def test_hf_rejects_other_architectures(tmp_path):
    write_hf(tmp_path, meta_state_dict(random_model()), TINY, extra_config={"model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    with pytest.raises(LlmcoreError) as e:
        loaders.load_hf(tmp_path, LoadOptions())
    assert "mistral" in str(e.value) and e.value.stage == "load" and e.value.plugin == "llama"


def test_meta_multi_shard_merge(tmp_path):
    cfg = replace(TINY, tie_embeddings=False)
    model = random_model(cfg)
    sd = meta_state_dict(model)
    write_meta(tmp_path, sd, cfg)
    os.remove(tmp_path / "consolidated.00.pth")
    shards = [{}, {}]
    for k, v in sd.items():
        if v.ndim == 1:
            parts = [v, v]
        elif k.endswith(("wo.weight", "w2.weight")) or k == "tok_embeddings.weight":  # Llama 2 splits embeddings by columns
            parts = list(v.chunk(2, dim=1))
        else:
            parts = list(v.chunk(2, dim=0))
        for s, p in zip(shards, parts):
            s[k] = p.clone()
    for i, s in enumerate(shards):
        torch.save(s, tmp_path / f"consolidated.{i:02d}.pth")
    lm = loaders.load_meta(tmp_path, LoadOptions())
    toks = tokens(7, cfg.vocab_size)
    torch.testing.assert_close(logits(lm, toks), model(toks).detach(), atol=ATOL, rtol=0)


def test_meta_file_path_and_options(tmp_path):
    model = random_model()
    write_meta(tmp_path, meta_state_dict(model), TINY)
    lm = loaders.load_meta(tmp_path / "consolidated.00.pth", LoadOptions(max_seq_len=32, dtype="bfloat16"))
    assert lm.metadata.max_seq_len == 32 and lm.module.freqs_cos.shape[0] == 32
    assert lm.module.tok_embeddings.weight.dtype == torch.bfloat16
    assert lm.tokenizer is None and lm.metadata.bos_id == -1


class _Payload:
    """Unpickling this object would run `exec`, creating a marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


@pytest.mark.parametrize("kind", ["zip", "legacy", "raw-pickle"])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, kind):
    marker = tmp_path / "pwned"
    write_meta(tmp_path, meta_state_dict(random_model()), TINY)
    ckpt = tmp_path / "consolidated.00.pth"
    evil = {"tok_embeddings.weight": torch.zeros(2), "x": _Payload(marker)}
    if kind == "zip":
        torch.save(evil, ckpt)
    elif kind == "legacy":
        torch.save(evil, ckpt, _use_new_zipfile_serialization=False)
    else:
        ckpt.write_bytes(pickle.dumps(evil, protocol=2))
    with pytest.raises(LlmcoreError) as e:
        loaders.load_meta(tmp_path, LoadOptions())
    assert not marker.exists()
    assert e.value.stage == "load" and e.value.plugin == "llama"
    assert "refusing to load" in e.value.message and "Nothing in it was executed" in e.value.message
    assert e.value.fix


def test_payload_is_live():
    """The payload above really executes under an unrestricted unpickler."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        marker = Path(d) / "pwned"
        pickle.loads(pickle.dumps(_Payload(marker)))
        assert marker.exists()


def test_loader_matching(tmp_path):
    model = random_model()
    sd = meta_state_dict(model)
    write_meta(tmp_path / "meta", sd, TINY)
    write_hf(tmp_path / "hf", sd, TINY)
    (tmp_path / "junk.bin").write_bytes(b"\0" * 100)
    by_name = {l.name: l for l in LOADERS}
    assert by_name["meta"].matches(tmp_path / "meta") and by_name["meta"].matches(tmp_path / "meta" / "consolidated.00.pth")
    assert by_name["hf"].matches(tmp_path / "hf") and not by_name["hf"].matches(tmp_path / "meta")
    assert not any(l.matches(tmp_path / "junk.bin") for l in LOADERS)
    assert not by_name["gguf"].matches(tmp_path / "hf")


def test_missing_path_is_a_load_error(tmp_path):
    with pytest.raises(LlmcoreError) as e:
        loaders.load_meta(tmp_path / "nope", LoadOptions())
    assert e.value.stage == "load"


def test_hf_pytorch_bin_is_read_safely(tmp_path):
    from llama_testutils import meta_to_hf, hf_config_dict

    model = random_model()
    sd = meta_state_dict(model)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(TINY)))
    torch.save(meta_to_hf(sd, TINY), tmp_path / "pytorch_model.bin")
    assert next(l for l in LOADERS if l.name == "hf").matches(tmp_path)
    lm = loaders.load_hf(tmp_path, LoadOptions())
    toks = tokens(6, TINY.vocab_size)
    torch.testing.assert_close(logits(lm, toks), logits(model, toks), atol=ATOL, rtol=0)

    marker = tmp_path / "pwned"
    torch.save({"x": _Payload(marker)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(LlmcoreError, match="refusing to load"):
        loaders.load_hf(tmp_path, LoadOptions())
    assert not marker.exists()
