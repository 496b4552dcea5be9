"""The Phi-3 / Phi-4-mini plugin against transformers' own ``Phi3ForCausalLM``.

Checkpoints are written by transformers (``save_pretrained``); the authority is its model
read back from the folder. ``phi4-mini`` has Phi-4-mini's switches: GQA, RoPE on 3/4 of each
head, LongRoPE (short and long factors, an attention factor from the length ratio), tied
embeddings. Exports run the CLI without ``--model``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from llmcore.errors import LlmcoreError
from llmcore.records import LoadOptions
from llmcore_llama.testing import (MAX_POS, check_eager_against, check_one_delegate_per_layer, check_program_against,
                                   check_refused_by_name, edit_config, export_cli, max_diff, reference, save_random_hf,
                                   tokens)

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
PAIRS = 6  # head_dim 16, 12 rotated channels
FAMILIES = {
    "phi3": dict(num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "phi4-mini": dict(
        max_position_embeddings=4 * MAX_POS, original_max_position_embeddings=MAX_POS, tie_word_embeddings=True,
        partial_rotary_factor=0.75,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "original_max_position_embeddings": MAX_POS,
                         "short_factor": [1.0, 1.1, 1.3, 1.8, 2.5, 3.0], "long_factor": [2.0, 3, 4, 5, 6, 8]},
    ),
}


def phi_checkpoint(folder: Path, family: str, tokenizer: bool = True, **config) -> Path:
    return save_random_hf(folder, "Phi3", tokenizer=tokenizer, pad_token_id=None, bos_token_id=None,
                          eos_token_id=None, **{**FAMILIES[family], **config})


def load(folder: Path, **options):
    import llmcore_phi

    return llmcore_phi.load_hf(folder, LoadOptions(**{"max_seq_len": MAX_POS, **options}))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_eager_logits_match_transformers(tmp_path, family):
    folder = phi_checkpoint(tmp_path / family, family)
    loaded = load(folder)
    cfg = loaded.module.config
    assert loaded.family == "phi"
    if family == "phi4-mini":
        assert cfg.rotary_dim == 2 * PAIRS and cfg.tie_embeddings and cfg.rope_freq_factors[1] == 1.1
        assert abs(cfg.rope_attention_factor - (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(64.0))).sqrt()) < 1e-6
    ref = reference(folder)
    check_eager_against(loaded.module, ref, ATOL)


@pytest.mark.parametrize("setting", ["partial-rotary", "short-factors", "attention-factor"])
def test_each_rope_setting_matters(tmp_path, setting):
    """The test can tell: dropping any one of Phi-4-mini's RoPE settings moves the logits."""
    from llmcore_llama.model import build_model

    folder = phi_checkpoint(tmp_path / "p4", "phi4-mini")
    ours = load(folder).module
    change = {"partial-rotary": dict(rotary_dim=None, rope_freq_factors=None),
              "short-factors": dict(rope_freq_factors=None),
              "attention-factor": dict(rope_attention_factor=1.0)}[setting]
    other = build_model(replace(ours.config, **change), ours.state_dict())
    toks = tokens(MAX_POS, seed=2)
    with torch.no_grad():
        assert max_diff(other(toks)[0], ours(toks)[0]) > 1e-2


def test_exported_program_matches_transformers(tmp_path):
    """``llmcore export --checkpoint DIR --max-seq-len 64`` (no --model) of Phi-4-mini's layout:
    fp32 XNNPACK with the KV cache, prefill logits at three lengths and 16 greedy tokens."""
    folder = phi_checkpoint(tmp_path / "p4", "phi4-mini")
    out = tmp_path / "out" / "phi.pte"
    report = export_cli(folder, out, "--max-seq-len", str(MAX_POS))
    assert report["model"]["family"] == "phi"
    check_program_against(out, reference(folder), ATOL)


def test_8da4w_export_lowers_one_delegate_per_layer(tmp_path):
    """The split q/k/v and gate/up projections and the partial RoPE stay inside XNNPACK."""
    folder = phi_checkpoint(tmp_path / "p4", "phi4-mini")
    report = export_cli(folder, tmp_path / "p4.pte", "--max-seq-len", str(MAX_POS), "--quantize", "8da4w")
    check_one_delegate_per_layer(report, 2)


def test_longrope_beyond_the_original_length_is_refused(tmp_path):
    folder = phi_checkpoint(tmp_path / "p4", "phi4-mini", tokenizer=False)
    with pytest.raises(LlmcoreError) as e:
        load(folder, max_seq_len=2 * MAX_POS)
    err = e.value
    assert str(err).startswith("[load/phi] ") and "long factors" in str(err) and "\n" not in str(err)
    assert f"--max-seq-len {MAX_POS}" in err.fix


def test_sliding_window_matches_transformers_past_the_window(tmp_path):
    """Phi-3-mini-4k ships ``sliding_window: 2047`` on every layer; here 8, compared at
    lengths 1/17/64."""
    folder = phi_checkpoint(tmp_path / "p3", "phi3", tokenizer=False, sliding_window=8)
    loaded = load(folder)
    assert all(loaded.module.config.window_of(i) == 8 for i in (0, 1))
    ref = reference(folder)
    check_eager_against(loaded.module, ref, ATOL)


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda c: c["rope_parameters"].update(short_factor=[1.0] * (PAIRS - 1)), ["'rope_parameters.short_factor'", f"{PAIRS} positive"]),
        (lambda c: c.update(lm_head_bias=True), ["'lm_head_bias'"]),
        (lambda c: c.update(full_attn_mod=2), ["'full_attn_mod'"]),
        (lambda c: c.update(some_new_switch=1), ["'some_new_switch'"]),
        (lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0), ["'yarn'"]),
    ],
    ids=["short-factor-length", "lm-head-bias", "remote-code-switch", "unknown-key", "yarn"],
)
def test_computational_keys_are_refused_by_name(tmp_path, change, named):
    check_refused_by_name(load, phi_checkpoint(tmp_path / "p4", "phi4-mini", tokenizer=False), change, "phi", named)


def test_phi4_mini_config_as_published_is_accepted(tmp_path):
    """Phi-4-mini-instruct's config.json as transformers 4.x wrote it (legacy ``rope_scaling``
    with ``type``, top-level partial_rotary_factor and original length, its custom-code keys)."""
    folder = phi_checkpoint(tmp_path / "p4", "phi4-mini", tokenizer=False)
    expected = reference(folder)(tokens(9)).logits[0, -1].detach()

    def legacy(c):
        params = c.pop("rope_parameters")
        c.update(rope_theta=params["rope_theta"], rope_scaling={"type": "longrope", "short_factor": params["short_factor"],
                                                                "long_factor": params["long_factor"]},
                 auto_map={"AutoConfig": "configuration_phi3.Phi3Config"}, full_attn_mod=1, interpolate_factor=1,
                 lm_head_bias=False, mlp_bias=False, attention_bias=False, sliding_window=262144, resid_pdrop=0.0,
                 embd_pdrop=0.0, bos_token_id=199999, eos_token_id=199999, torch_dtype="bfloat16")

    edit_config(folder, legacy)
    with torch.no_grad():
        assert max_diff(load(folder).module(tokens(9))[0], expected) <= ATOL


def test_random_configs_build():
    import llmcore_phi

    for name in ("phi3-tiny", "phi4-mini-tiny"):
        loaded = llmcore_phi.family().build_random(name, LoadOptions())
        with torch.no_grad():
            assert loaded.module(tokens(7)).shape[-1] == 320


# --------------------------------------------------------------------------------------
# GGUF: files written as llama.cpp's converter writes phi3 (fused attn_qkv and ffn_up, q/k
# rows in rotate-half order, LongRoPE factors as tensors), compared with transformers.
# --------------------------------------------------------------------------------------


def phi_gguf(folder: Path, path: Path, quantize: dict | None = None) -> dict:
    """The Phi3 checkpoint in ``folder`` as llama.cpp's Phi3MiniModel converter writes it."""
    import math

    import numpy as np
    from llmcore_llama.testing import write_gguf

    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg["rope_parameters"]
    rotary = int(rope.get("partial_rotary_factor", 1.0) * cfg["hidden_size"]) // cfg["num_attention_heads"]
    original = rope.get("original_max_position_embeddings", cfg["max_position_embeddings"])

    def metadata(w, cfg):
        w.add_rope_dimension_count(rotary)
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = cfg["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)

    extra = {}
    if rope.get("long_factor"):
        extra = {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
                 "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)}
    return write_gguf(folder, path, quantize=quantize, metadata=metadata, extra_tensors=extra)


@pytest.mark.parametrize("family, config", [("phi3", dict(sliding_window=8)), ("phi4-mini", {})],
                         ids=["phi3-sliding", "phi4-mini"])
def test_gguf_as_llama_cpp_writes_it_matches_transformers(tmp_path, family, config):
    import llmcore_phi

    folder = phi_checkpoint(tmp_path / family, family, tokenizer=False, **config)
    path = tmp_path / f"{family}.gguf"
    phi_gguf(folder, path)
    assert llmcore_phi.family().loader("gguf").claims(path)
    loaded = llmcore_phi.load_gguf(path, LoadOptions(max_seq_len=MAX_POS))
    hf = load(folder).module.config
    for name in ("rotary_dim", "sliding_window", "tie_embeddings"):
        assert getattr(loaded.module.config, name) == getattr(hf, name), name
    for name in ("rope_freq_factors", "rope_attention_factor"):  # stored in float32, as transformers uses them
        assert torch.allclose(torch.tensor(getattr(loaded.module.config, name) or 0.0),
                              torch.tensor(getattr(hf, name) or 0.0)), name
    check_eager_against(loaded.module, reference(folder), ATOL)


def test_gguf_longrope_beyond_the_original_length_is_refused(tmp_path):
    import llmcore_phi

    folder = phi_checkpoint(tmp_path / "p4", "phi4-mini", tokenizer=False)
    phi_gguf(folder, tmp_path / "p4.gguf")
    with pytest.raises(LlmcoreError) as e:
        llmcore_phi.load_gguf(tmp_path / "p4.gguf", LoadOptions(max_seq_len=2 * MAX_POS))
    assert str(e.value).startswith("[load/phi] ") and "long factors" in str(e.value)
    assert f"--max-seq-len {MAX_POS}" in e.value.fix


def test_quantized_fused_gguf_keeps_its_integers_per_split_matrix(tmp_path):
    """Q4_0 ``attn_qkv`` and Q8_0 ``ffn_up``: each matrix split out of them keeps its rows'
    integers, which dequantize to the gguf package's own dequantization of those rows (q
    and k put in the decoder's rotary order)."""
    import gguf
    from gguf import quants as gq
    from llmcore_llama.loaders import unpermute_hf_rotary

    import llmcore_phi

    folder = phi_checkpoint(tmp_path / "p4", "phi4-mini", tokenizer=False)
    Q = gguf.GGMLQuantizationType
    written = phi_gguf(folder, tmp_path / "p4.gguf", {"attn_qkv.weight": Q.Q4_0, "ffn_up.weight": Q.Q8_0})
    loaded = llmcore_phi.load_gguf(tmp_path / "p4.gguf", LoadOptions(max_seq_len=MAX_POS))
    kept = llmcore_phi.load_gguf(tmp_path / "p4.gguf", LoadOptions(max_seq_len=MAX_POS, stored_integers=True))
    cfg, sd = loaded.module.config, loaded.module.state_dict()
    qkv = torch.from_numpy(gq.dequantize(written["blk.1.attn_qkv.weight"][1], Q.Q4_0)).float()
    q, k, v = qkv.split([4 * 16, 2 * 16, 2 * 16])
    up = torch.from_numpy(gq.dequantize(written["blk.0.ffn_up.weight"][1], Q.Q8_0)).float()
    expected = {"layers.1.attention.wq.weight": unpermute_hf_rotary(q, 4, cfg.rotary_dim),
                "layers.1.attention.wk.weight": unpermute_hf_rotary(k, 2, cfg.rotary_dim),
                "layers.1.attention.wv.weight": v,
                "layers.0.feed_forward.w1.weight": up[:160], "layers.0.feed_forward.w3.weight": up[160:]}
    for meta, want in expected.items():
        assert torch.equal(sd[meta], want), meta
        in_file = kept.stored_weights[meta]  # left in the file: read by rows, or its integers
        assert torch.equal(in_file.read_floats(slice(None)), want), meta
        assert torch.equal(in_file.read_floats(slice(3, 17)), want[3:17]), meta
        assert torch.equal(in_file.read_integers().dequantize(), want), meta


def test_gguf_recipe_export_of_a_q4_0_phi_file(tmp_path):
    """A Q4_0 Phi-4-mini-shaped GGUF through ``--quantize gguf`` on XNNPACK, the family read
    from the file: the program agrees with its eager model."""
    import gguf
    from llmcore_llama.testing import gguf_recipe_export

    folder = phi_checkpoint(tmp_path / "p4", "phi4-mini")
    path = tmp_path / "p4.gguf"
    phi_gguf(folder, path, dict.fromkeys(("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight"),
                                         gguf.GGMLQuantizationType.Q4_0))
    report = gguf_recipe_export(path, folder / "tokenizer.json", tmp_path / "out.pte", "--max-seq-len", str(MAX_POS))
    assert report["model"]["family"] == "phi"
    # int8 activations round differently in XNNPACK and eager PyTorch: 0.03 here, with the
    # same next token everywhere
    assert report["parity"]["max_abs_diff"] < 0.1, report["parity"]
