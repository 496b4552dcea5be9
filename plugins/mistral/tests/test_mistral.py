"""The Mistral plugin against transformers' own ``MistralForCausalLM``: a sliding window of
8 on every layer, compared far past it, eagerly and as an exported program."""

from __future__ import annotations

import pytest
import torch

from llmcore.records import LoadOptions
from llmcore_llama.testing import (check_eager_against, check_one_delegate_per_layer, check_program_against,
                                   check_refused_by_name, edit_config, export_cli, max_diff, reference, save_random_hf,
                                   tokens)

transformers = pytest.importorskip("transformers")

ATOL = 1e-4


def mistral_checkpoint(folder, tokenizer: bool = True, **config):
    return save_random_hf(folder, "Mistral", tokenizer=tokenizer, sliding_window=8, head_dim=24,
                          pad_token_id=None, **config)


def load(folder, **options):
    import llmcore_mistral

    return llmcore_mistral.load_hf(folder, LoadOptions(**options))


def test_eager_logits_match_transformers_past_the_window(tmp_path):
    folder = mistral_checkpoint(tmp_path / "m")
    loaded = load(folder)
    assert loaded.family == "mistral" and loaded.module.config.window_of(1) == 8
    ref = reference(folder)
    check_eager_against(loaded.module, ref, ATOL)


def test_the_window_matters(tmp_path):
    from dataclasses import replace

    from llmcore_llama.model import build_model

    ours = load(mistral_checkpoint(tmp_path / "m", tokenizer=False)).module
    full = build_model(replace(ours.config, sliding_window=None), ours.state_dict())
    toks = tokens(40)
    with torch.no_grad():
        assert max_diff(full(toks)[0], ours(toks)[0]) > 1e-2


def test_exported_program_matches_transformers(tmp_path):
    """No --model; fp32 XNNPACK with the KV cache keeping the window: prefill at three
    lengths and 16 greedy tokens past the window."""
    folder = mistral_checkpoint(tmp_path / "m")
    out = tmp_path / "out" / "m.pte"
    report = export_cli(folder, out)
    assert report["model"]["family"] == "mistral"
    check_program_against(out, reference(folder), ATOL)


def test_8da4w_export_lowers_one_delegate_per_layer(tmp_path):
    folder = mistral_checkpoint(tmp_path / "m")
    check_one_delegate_per_layer(export_cli(folder, tmp_path / "m.pte", "--quantize", "8da4w"), 2)


def test_no_window_is_full_attention(tmp_path):
    """Mistral-7B-v0.2 and later: ``sliding_window: null``."""
    folder = mistral_checkpoint(tmp_path / "m", tokenizer=False)
    edit_config(folder, lambda c: c.update(sliding_window=None))
    loaded = load(folder)
    assert loaded.module.config.sliding_window is None
    toks = tokens(40)
    with torch.no_grad():
        assert max_diff(loaded.module(toks)[0], reference(folder)(toks).logits[0, -1]) <= ATOL


@pytest.mark.parametrize("change, named", [
    (lambda c: c.update(sliding_window=-3), ["'sliding_window'"]),
    (lambda c: c.update(hidden_act="gelu"), ["'hidden_act'"]),
    (lambda c: c.update(some_new_switch=1), ["'some_new_switch'"]),
], ids=["bad-window", "hidden-act", "unknown-key"])
def test_computational_keys_are_refused_by_name(tmp_path, change, named):
    check_refused_by_name(load, mistral_checkpoint(tmp_path / "m", tokenizer=False), change, "mistral", named)
