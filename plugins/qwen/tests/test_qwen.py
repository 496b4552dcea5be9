"""The Qwen2 / Qwen3 plugin against transformers' own models.

Every checkpoint is written by transformers (``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``,
``save_pretrained``); the authority is transformers' model read back from the folder. The
exports run the CLI as a user does, without ``--model`` (the family comes from config.json).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmcore.errors import LlmcoreError
from llmcore.records import LoadOptions
from llmcore_llama.testing import (LONG_POSITIONS, LONG_SEQ_LEN, check_eager_against, check_long_prompt_against,
                                   check_one_delegate_per_layer, check_program_against, check_refused_by_name,
                                   edit_config, export_cli, llmcore_cli, max_diff, reference, tokens)
from qwen_testutils import hf_checkpoint

transformers = pytest.importorskip("transformers")

ATOL = 1e-4


def load(folder: Path, **options):
    import llmcore_qwen

    return llmcore_qwen.load_hf(folder, LoadOptions(**options))


def test_the_family_is_listed_with_its_loader():
    out = llmcore_cli("plugins")
    assert out.returncode == 0, out.stderr
    assert "qwen" in out.stdout and "llmcore-qwen" in out.stdout


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3-bias"])
def test_eager_logits_match_transformers(tmp_path, family):
    folder = hf_checkpoint(tmp_path / family, family)
    loaded = load(folder)
    cfg = loaded.module.config
    assert loaded.family == "qwen"
    assert cfg.qkv_bias == (family != "qwen3") and cfg.qk_norm == family.startswith("qwen3")
    assert cfg.o_bias == (family == "qwen3-bias") and cfg.tie_embeddings == (family != "qwen3-bias")
    check_eager_against(loaded.module, reference(folder), ATOL)


def test_the_layout_matters(tmp_path):
    """The test can tell: without Qwen3's q/k norms the logits move by far more than ATOL."""
    from dataclasses import replace

    from llmcore_llama.model import build_model

    folder = hf_checkpoint(tmp_path / "q3", "qwen3")
    ours = load(folder).module
    state = {k: v for k, v in ours.state_dict().items() if "q_norm" not in k and "k_norm" not in k}
    without = build_model(replace(ours.config, qk_norm=False), state)
    toks = tokens(17)
    with torch.no_grad():
        assert max_diff(without(toks)[0], ours(toks)[0]) > 1e-2


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_exported_program_matches_transformers(tmp_path, family):
    """``llmcore export --checkpoint DIR`` (no --model): fp32 XNNPACK program with the KV
    cache; prefill logits at three lengths and 16 greedy tokens equal transformers', and
    the logits of a 600-token prompt and 15 decode steps after it."""
    folder = hf_checkpoint(tmp_path / family, family, max_position_embeddings=LONG_POSITIONS)
    out = tmp_path / "out" / f"{family}.pte"
    report = export_cli(folder, out, "--max-seq-len", str(LONG_SEQ_LEN))
    assert report["model"]["family"] == "qwen" and report["model"]["metadata"]["chat_template"]
    assert (out.parent / "tokenizer.json").is_file()
    ref = reference(folder)
    check_program_against(out, ref, ATOL)
    check_long_prompt_against(out, ref, ATOL)


def test_8da4w_export_lowers_one_delegate_per_layer(tmp_path):
    """Qwen3's per-head q/k norms stay inside XNNPACK, as Llama's layers do."""
    folder = hf_checkpoint(tmp_path / "q3", "qwen3")
    check_one_delegate_per_layer(export_cli(folder, tmp_path / "q3.pte", "--quantize", "8da4w"), 2)


def test_sliding_window_layers_match_transformers_past_the_window(tmp_path):
    """``use_sliding_window`` with ``max_window_layers: 1``: layer 1 sees 8 positions,
    layer 0 all. Eager and ``.pte`` (the KV cache keeps the window) match transformers at
    lengths 1/17/64 and for 16 greedy tokens after a 5-token prompt, all past the window."""
    folder = hf_checkpoint(tmp_path / "sw", "qwen2", use_sliding_window=True, sliding_window=8,
                           max_window_layers=1)
    loaded = load(folder)
    assert loaded.module.config.window_of(0) is None and loaded.module.config.window_of(1) == 8
    ref = reference(folder)
    check_eager_against(loaded.module, ref, ATOL)
    out = tmp_path / "out" / "sw.pte"
    export_cli(folder, out)
    check_program_against(out, ref, ATOL)


@pytest.mark.parametrize(
    "family, change, named",
    [
        ("qwen2", lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                      "original_max_position_embeddings": 16}),
         ["'rope_parameters.rope_type'", "'yarn'"]),
        ("qwen3", lambda c: c.update(some_new_switch=2.0), ["'some_new_switch'"]),
        ("qwen3", lambda c: c.update(hidden_act="gelu"), ["'hidden_act'", "'gelu'"]),
        ("qwen2", lambda c: c.update(layer_types=["full_attention", "chunked_attention"]), ["'chunked_attention'"]),
    ],
    ids=["yarn", "unknown-key", "hidden-act", "layer-type"],
)
def test_computational_keys_are_refused_by_name(tmp_path, family, change, named):
    check_refused_by_name(load, hf_checkpoint(tmp_path / family, family, tokenizer=False), change, "qwen", named)


def test_harmless_keys_are_accepted(tmp_path):
    """Keys published Qwen2.5 configs carry (a window that is off, bos/eos ids, dtype)."""
    folder = hf_checkpoint(tmp_path / "q2", "qwen2", tokenizer=False)
    expected = reference(folder)(tokens(9)).logits[0, -1].detach()
    edit_config(folder, lambda c: c.update(use_sliding_window=False, sliding_window=32768, max_window_layers=21,
                                           bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16",
                                           use_mrope=False, attention_dropout=0.0))
    with torch.no_grad():
        assert max_diff(load(folder).module(tokens(9))[0], expected) <= ATOL


def test_other_families_refuse_each_others_checkpoints(tmp_path):
    """``--model llama`` on a Qwen folder, and ``--model qwen`` on a Llama one: one line each."""
    qwen = hf_checkpoint(tmp_path / "q2", "qwen2", tokenizer=False)
    run = llmcore_cli("export", "--model", "llama", "--checkpoint", str(qwen), "--plugins", "xnnpack",
                      "-o", str(tmp_path / "x.pte"))
    assert run.returncode != 0 and "qwen2" in run.stderr and "[load/llama]" in run.stderr, run.stderr
    assert not (tmp_path / "x.pte").exists()

    edit_config(qwen, lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"]))
    with pytest.raises(LlmcoreError) as e:
        load(qwen)
    assert e.value.plugin == "qwen" and "llama" in str(e.value)


def test_a_family_that_is_not_installed_names_its_plugin(tmp_path):
    """Without the qwen plugin loaded, exporting a Qwen folder names llmcore-qwen; an
    architecture no plugin reads says to pass --model."""
    folder = hf_checkpoint(tmp_path / "q3", "qwen3", tokenizer=False)
    run = llmcore_cli("export", "--checkpoint", str(folder), "-o", str(tmp_path / "x.pte"),
                      env={"LLMCORE_LOAD_PLUGINS": "llama,nanogpt,xnnpack"})
    assert run.returncode != 0 and "pip install llmcore-qwen" in run.stderr and "qwen3" in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1

    edit_config(folder, lambda c: c.update(model_type="olmo2", architectures=["Olmo2ForCausalLM"]))
    run = llmcore_cli("export", "--checkpoint", str(folder), "-o", str(tmp_path / "x.pte"))
    assert run.returncode != 0 and "olmo2" in run.stderr and "--model" in run.stderr, run.stderr
    assert not (tmp_path / "x.pte").exists()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_gguf_as_llama_cpp_writes_it_matches_transformers(tmp_path, family):
    """llama.cpp keeps Qwen's q/k rows in rotate-half order: the loader permutes them (with
    their biases and norms) and the logits match transformers'."""
    from qwen_testutils import write_gguf

    import llmcore_qwen

    folder = hf_checkpoint(tmp_path / family, family, tokenizer=False)
    gguf_path = tmp_path / f"{family}.gguf"
    write_gguf(folder, gguf_path)
    assert llmcore_qwen.family().loader("gguf").claims(gguf_path)
    loaded = llmcore_qwen.load_gguf(gguf_path, LoadOptions())
    assert loaded.module.config.qkv_bias == (family == "qwen2") and loaded.module.config.qk_norm == (family == "qwen3")
    ref = reference(folder)
    check_eager_against(loaded.module, ref, ATOL)


def test_quantized_gguf_keeps_its_integers_in_the_decoder_order(tmp_path):
    """Q4_0 / Q8_0 q and k: the stored integers are permuted with the rows, so they still
    dequantize to the weights the loader uses, and those equal the gguf package's own
    dequantization put in the decoder's order."""
    import gguf
    from gguf import quants as gq
    from llmcore_llama.loaders import unpermute_hf_rotary
    from qwen_testutils import write_gguf

    import llmcore_qwen

    folder = hf_checkpoint(tmp_path / "q2", "qwen2", tokenizer=False)
    path = tmp_path / "q2.gguf"
    Q = gguf.GGMLQuantizationType
    written = write_gguf(folder, path, {"attn_q.weight": Q.Q4_0, "attn_k.weight": Q.Q8_0, "ffn_up.weight": Q.Q4_0})
    loaded = llmcore_qwen.load_gguf(path, LoadOptions())
    kept = llmcore_qwen.load_gguf(path, LoadOptions(stored_integers=True))
    sd = loaded.module.state_dict()
    for gname, meta, heads in (("blk.0.attn_q.weight", "layers.0.attention.wq.weight", 4),
                               ("blk.1.attn_k.weight", "layers.1.attention.wk.weight", 2),
                               ("blk.0.ffn_up.weight", "layers.0.feed_forward.w3.weight", None)):
        qt, data = written[gname]
        expected = torch.from_numpy(gq.dequantize(data, qt)).float()
        if heads:
            expected = unpermute_hf_rotary(expected, heads)
        assert torch.equal(sd[meta], expected), meta
        in_file = kept.stored_weights[meta]  # left in the file: read by rows, or its integers
        assert torch.equal(in_file.read_floats(slice(None)), expected), meta
        assert torch.equal(in_file.read_floats(slice(3, 17)), expected[3:17]), meta
        assert torch.equal(in_file.read_integers().dequantize(), expected), meta


def test_gguf_recipe_export_of_a_qwen2_q4_0_file(tmp_path):
    """A Q4_0 Qwen2 GGUF (biased q/k/v) through ``--quantize gguf`` on XNNPACK, family read
    from the file: the program runs and agrees with its eager model."""
    import gguf
    from llmcore_llama.testing import GGUF_LAYER_MATRICES, gguf_recipe_export
    from qwen_testutils import write_gguf

    folder = hf_checkpoint(tmp_path / "q2", "qwen2")
    path = tmp_path / "q2.gguf"
    write_gguf(folder, path, dict.fromkeys(GGUF_LAYER_MATRICES, gguf.GGMLQuantizationType.Q4_0))
    report = gguf_recipe_export(path, folder / "tokenizer.json", tmp_path / "out.pte")
    assert report["model"]["family"] == "qwen"
    assert report["parity"]["top1_agreement"] == 1.0 and report["parity"]["max_abs_diff"] < 1e-2, report["parity"]
