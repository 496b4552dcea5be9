"""The Gemma plugin against transformers' own ``GemmaForCausalLM``, ``Gemma2ForCausalLM``
and ``Gemma3ForCausalLM``: tiny random checkpoints they save, compared eagerly and as
exported programs, past the sliding window."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llmcore.records import LoadOptions
from llmcore_llama.testing import (LONG_POSITIONS, LONG_SEQ_LEN, check_eager_against, check_long_prompt_against,
                                   check_one_delegate_per_layer, check_program_against, check_refused_by_name,
                                   edit_config, export_cli, max_diff, reference, save_random_hf, tokens)

transformers = pytest.importorskip("transformers")

ATOL = 1e-4

# Small enough to run in seconds, with every setting away from its default so that a
# misread one moves the logits: head_dim 24 (not dim / heads), query_pre_attn_scalar 20
# (not head_dim), caps that bite, a window of 8 that the tests run past.
GEMMA2 = dict(head_dim=24, sliding_window=8, query_pre_attn_scalar=20, attn_logit_softcapping=5.0,
              final_logit_softcapping=3.0, pad_token_id=None)
# Gemma 3: 3 layers (sliding, global, sliding), the global RoPE linearly scaled, the local
# base different from the global one.
GEMMA3 = dict(config_kind="Gemma3Text", head_dim=24, sliding_window=8, query_pre_attn_scalar=20, num_hidden_layers=3,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"], pad_token_id=None,
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
GEMMA = dict(head_dim=24, pad_token_id=None)
KINDS = {"gemma": ("Gemma", GEMMA), "gemma2": ("Gemma2", GEMMA2), "gemma3": ("Gemma3", GEMMA3)}


def checkpoint(folder, name: str, tokenizer: bool = True, **config):
    kind, base = KINDS[name]
    return save_random_hf(folder, kind, tokenizer=tokenizer, **{**base, **config})


def load(folder, **options):
    import llmcore_gemma

    return llmcore_gemma.load_hf(folder, LoadOptions(**options))


@pytest.mark.parametrize("name", list(KINDS))
def test_eager_logits_match_transformers(tmp_path, name):
    folder = checkpoint(tmp_path / name, name, tokenizer=False)
    loaded = load(folder)
    assert loaded.family == "gemma"
    check_eager_against(loaded.module, reference(folder), ATOL)


def test_gemma3_legacy_rope_keys(tmp_path):
    """Hub configs of Gemma 3 (transformers 4.5x) give ``rope_theta``, ``rope_scaling`` (global
    layers only), ``rope_local_base_freq`` and ``sliding_window_pattern`` at the top level."""
    folder = checkpoint(tmp_path / "g3", "gemma3", tokenizer=False)
    ref = reference(folder)

    def legacy(c):
        c.pop("rope_parameters")
        c.pop("layer_types")
        c.update(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_local_base_freq=1e4,
                 sliding_window_pattern=2)  # layers 0 and 2 slide, as layer_types said

    edit_config(folder, legacy)
    model = load(folder).module
    assert model.config.sliding_layers == (0, 2) and model.config.rope_local_theta == 1e4
    check_eager_against(model, ref, ATOL)


@pytest.mark.parametrize("switch, off", [
    ("attn_softcap", None), ("final_softcap", None), ("attention_scale", None), ("sandwich_norms", False),
    ("embedding_multiplier", 1.0), ("rope_local_theta", None), ("sliding_window", None),
])
def test_each_switch_matters(tmp_path, switch, off):
    """Every Gemma setting moves the logits of these checkpoints by far more than the
    tolerance, so the comparisons above would catch one that is misread."""
    from llmcore_llama.model import build_model

    name = "gemma3" if switch == "rope_local_theta" else "gemma2"
    ours = load(checkpoint(tmp_path / name, name, tokenizer=False)).module
    sd = ours.state_dict()
    if switch == "sandwich_norms":
        sd = {k: v for k, v in sd.items() if "post_norm" not in k}
    changed = build_model(replace(ours.config, **{switch: off}), sd)
    toks = tokens(40)
    with torch.no_grad():
        assert max_diff(changed(toks)[0], ours(toks)[0]) > 1e-2


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_exported_program_matches_transformers(tmp_path, name):
    """No --model; fp32 XNNPACK with the KV cache: prefill at three lengths and 16 greedy
    tokens past the window; then a 600-token prompt and 15 decode steps, the global layers
    reading 600 keys and more."""
    from llmcore.runtime import libraries

    folder = checkpoint(tmp_path / name, name, max_position_embeddings=LONG_POSITIONS)
    out = tmp_path / "out" / f"{name}.pte"
    report = export_cli(folder, out, "--max-seq-len", str(LONG_SEQ_LEN))
    assert report["model"]["family"] == "gemma"
    # the attention on the runtime's kernel (where it is built, as make test builds it), Gemma 2's soft-capped
    calls = libraries.program_operators(out.read_bytes())
    assert ("llmcore::softcap_sdpa.out" in calls) == (name == "gemma2" and libraries.llm_ops_built())
    ref = reference(folder)
    check_program_against(out, ref, ATOL)
    check_long_prompt_against(out, ref, ATOL)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_8da4w_export_lowers_one_delegate_per_layer(tmp_path, name):
    """Gemma 2's soft-capped attention is llmcore::softcap_sdpa between delegates, as the
    cache ops are; Gemma 3's two RoPE tables are computed once, before the layers."""
    folder = checkpoint(tmp_path / name, name)
    n_layers = 3 if name == "gemma3" else 2
    check_one_delegate_per_layer(export_cli(folder, tmp_path / f"{name}.pte", "--quantize", "8da4w"), n_layers)


@pytest.mark.parametrize("name, change, named", [
    ("gemma2", lambda c: c.update(hidden_activation="gelu"), ["'hidden_activation'"]),
    ("gemma", lambda c: c.update(hidden_act="relu"), ["'hidden_act'"]),
    ("gemma3", lambda c: c.update(attn_logit_softcapping=50.0), ["'attn_logit_softcapping'"]),
    ("gemma3", lambda c: c.update(use_bidirectional_attention=True), ["'use_bidirectional_attention'"]),
    ("gemma2", lambda c: c.update(layer_types=["chunked_attention", "full_attention"]), ["'layer_types'"]),
    ("gemma3", lambda c: c["rope_parameters"]["sliding_attention"].update(rope_type="linear", factor=4.0),
     ["sliding_attention"]),
    ("gemma3", lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn", factor=4.0), ["'yarn'"]),
    ("gemma2", lambda c: c.update(query_pre_attn_scalar=-1), ["'query_pre_attn_scalar'"]),
    ("gemma2", lambda c: c.update(some_new_switch=1), ["'some_new_switch'"]),
], ids=["exact-gelu", "gemma1-act", "gemma3-attn-softcap", "bidirectional", "layer-type", "local-rope-scaled",
        "global-yarn", "bad-scalar", "unknown-key"])
def test_computational_keys_are_refused_by_name(tmp_path, name, change, named):
    check_refused_by_name(load, checkpoint(tmp_path / name, name, tokenizer=False), change, "gemma", named)


def test_gemma_legacy_gelu_is_the_tanh_approximation(tmp_path):
    """Gemma 1's released configs say ``hidden_act: gelu``; transformers runs the tanh GELU
    they were trained with, and so does the plugin."""
    folder = checkpoint(tmp_path / "g", "gemma", tokenizer=False)
    ref = reference(folder)
    edit_config(folder, lambda c: c.update(hidden_act="gelu"))
    check_eager_against(load(folder).module, ref, ATOL)


def test_random_configs_build_and_run():
    import llmcore_gemma

    family = llmcore_gemma.family()
    for name in ("gemma2-tiny", "gemma3-tiny"):
        model = family.build_random(name, LoadOptions()).module
        logits = model(torch.randint(0, 320, (1, 20)))
        assert logits.shape == (1, 320) and torch.isfinite(logits).all()


# --------------------------------------------------------------------------------------
# GGUF: files written as llama.cpp's converter writes gemma / gemma2 / gemma3 (norms
# already 1 + w, q/k rows in rotate-half order), compared with transformers. llama.cpp
# scales attention by head_dim ** -0.5 below the 27B sizes, so these checkpoints keep
# query_pre_attn_scalar at head_dim (24).
# --------------------------------------------------------------------------------------


def gemma_gguf(folder, path, quantize: dict | None = None) -> dict:
    """The checkpoint in ``folder`` as llama.cpp's Gemma converters write it; Gemma 3's
    layer pattern as one flag per layer (llama.cpp reads either that or N)."""
    import json

    import gguf
    from llmcore_llama.testing import write_gguf

    def metadata(w, cfg):
        if cfg.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if cfg["model_type"] != "gemma":
            w.add_sliding_window(cfg["sliding_window"])
        if cfg["model_type"] == "gemma3_text":
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
            rope = cfg["rope_parameters"]
            w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["full_attention"]["factor"])

    cfg = json.loads((folder / "config.json").read_text())
    assert cfg.get("query_pre_attn_scalar", cfg["head_dim"]) == cfg["head_dim"], "llama.cpp cannot represent it"
    return write_gguf(folder, path, quantize=quantize, metadata=metadata,
                      convert=lambda name, t: t + 1.0 if name.endswith("norm.weight") else t)


@pytest.mark.parametrize("name", list(KINDS))
def test_gguf_as_llama_cpp_writes_it_matches_transformers(tmp_path, name):
    import llmcore_gemma

    scalar = {} if name == "gemma" else dict(query_pre_attn_scalar=24)
    folder = checkpoint(tmp_path / name, name, tokenizer=False, **scalar)
    path = tmp_path / f"{name}.gguf"
    gemma_gguf(folder, path)
    assert llmcore_gemma.family().loader("gguf").claims(path)
    loaded = llmcore_gemma.load_gguf(path, LoadOptions())
    hf = load(folder).module.config
    for field in ("sliding_window", "sliding_layers", "rope_local_theta", "rope_linear_factor", "attn_softcap",
                  "final_softcap", "sandwich_norms", "qk_norm", "embedding_multiplier"):
        assert getattr(loaded.module.config, field) == getattr(hf, field), field
    check_eager_against(loaded.module, reference(folder), ATOL)


def test_gguf_gemma2_defaults_are_llama_cpps():
    """Keys a Gemma 2 GGUF leaves out mean what llama.cpp assumes: window 4096, every other
    layer sliding from the first, caps 50 and 30; 46 layers (the 27B) scale q by
    (dim / heads) ** -0.5."""
    from types import SimpleNamespace

    from llmcore_gemma.keys import gguf_switches

    def view(n_layers, **meta):
        return SimpleNamespace(arch="gemma2", get=lambda suffix, default=None: meta.get(suffix, default),
                               fields=dict(dim=4608, n_heads=32, n_layers=n_layers, rope_linear_factor=1.0))

    small = gguf_switches(view(4))
    assert small["sliding_window"] == 4096 and small["sliding_layers"] == (0, 2)
    assert small["attn_softcap"] == 50.0 and small["final_softcap"] == 30.0 and "attention_scale" not in small
    assert gguf_switches(view(46))["attention_scale"] == 144 ** -0.5
    assert gguf_switches(view(6, **{"attention.sliding_window_pattern": 3}))["sliding_layers"] == (0, 1, 3, 4)


def test_gguf_recipe_export_of_a_q4_0_gemma3_file(tmp_path):
    """A Q4_0 Gemma 3 GGUF through ``--quantize gguf`` on XNNPACK, family read from the file:
    the program agrees with its eager model past the window."""
    import gguf
    from llmcore_llama.testing import GGUF_LAYER_MATRICES, gguf_recipe_export

    folder = checkpoint(tmp_path / "g3", "gemma3", query_pre_attn_scalar=24)
    path = tmp_path / "g3.gguf"
    gemma_gguf(folder, path, dict.fromkeys(GGUF_LAYER_MATRICES, gguf.GGMLQuantizationType.Q4_0))
    report = gguf_recipe_export(path, folder / "tokenizer.json", tmp_path / "out.pte")
    assert report["model"]["family"] == "gemma"
    assert report["parity"]["max_abs_diff"] < 0.1, report["parity"]
