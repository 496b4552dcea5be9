"""The Phi-3 / Phi-4-mini plugin against transformers' own ``Phi3ForCausalLM``.

Checkpoints are written by transformers (``save_pretrained``); the authority is its model
read back from the folder. ``phi4-mini`` has Phi-4-mini's switches: GQA, RoPE on 3/4 of each
head, LongRoPE (short and long factors, an attention factor from the length ratio), tied
embeddings. Exports run the CLI without ``--model``.
"""

from __future__ import annotations

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
