"""No config key silently misread: RoPE forms against transformers, and refusals by name.

Tiny random LlamaForCausalLM checkpoints are written by transformers itself
(``save_pretrained``, safetensors) in its current ``rope_parameters`` form and, by editing
config.json, in the legacy top-level ``rope_theta`` / ``rope_scaling`` form. llmcore's HF
loader must give transformers' logits (fp32, max |diff| <= 1e-4) at three lengths.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from llmcore_llama.testing import edit_config, save_random_hf
from llama_testutils import TINY, meta_state_dict, random_model, reference_forward, tokens, write_gguf, write_meta
from llmcore.errors import LlmcoreError
from llmcore.records import LoadOptions
from llmcore_llama import keys, loaders
from llmcore_llama.model import build_model

transformers = pytest.importorskip("transformers")

MAX_POS = 64
LENGTHS = (1, 17, MAX_POS)
ATOL = 1e-4

# rope_parameters of each form the family implements; each differs from plain theta 10000
# within 64 positions, so ignoring it shows in the logits.
ROPE_FORMS = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},  # a no-op within MAX_POS
}


def hf_checkpoint(folder: Path, rope: dict, *, legacy: bool = False, seed: int = 0, **config) -> Path:
    """A tiny random LlamaForCausalLM saved by transformers; ``legacy`` rewrites its
    config.json in the top-level rope_theta / rope_scaling form of transformers 4.x."""
    save_random_hf(folder, "Llama", seed=seed, tokenizer=False, rms_norm_eps=1e-5, tie_word_embeddings=False,
                   rope_parameters=dict(rope), **config)
    if legacy:
        edit_config(folder, lambda c: legacy_form(c))
    return folder


def legacy_form(c: dict) -> None:
    params = dict(c.pop("rope_parameters"))
    c["rope_theta"] = params.pop("rope_theta")
    c["rope_scaling"] = None if params["rope_type"] == "default" else params


def hf_logits(folder: Path, toks: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(toks).logits[0, -1]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.reshape(-1) - b.reshape(-1)).abs().max().item()


@pytest.mark.parametrize("form", ["new", "legacy"])
@pytest.mark.parametrize("rope", list(ROPE_FORMS))
def test_rope_forms_match_transformers(tmp_path, rope, form):
    folder = hf_checkpoint(tmp_path / "hf", ROPE_FORMS[rope], legacy=form == "legacy")
    written = json.loads((folder / "config.json").read_text())
    assert ("rope_parameters" in written) == (form == "new") and ("rope_theta" in written) == (form == "legacy")
    ours = loaders.load_hf(folder, LoadOptions()).module
    plain = build_model(replace(ours.config, rope_theta=10000.0, rope_scaling=None, rope_linear_factor=1.0),
                        ours.state_dict())
    worst = 0.0
    for n in LENGTHS:
        toks = tokens(n, 320, seed=n)
        expected = hf_logits(folder, toks)
        with torch.no_grad():
            got = ours(toks)[0]
            ignored = plain(toks)[0]
        diff = max_diff(got, expected)
        assert diff <= ATOL, f"{rope}/{form}, length {n}: max |diff| {diff}"
        worst = max(worst, diff)
        if n == MAX_POS and rope != "dynamic":  # the test can tell: without the RoPE settings it fails
            assert max_diff(ignored, expected) > 1e-2
    print(f"{rope}/{form}: max |logit diff| vs transformers {worst:.2e}")


def test_legacy_type_key_and_both_forms_agreeing(tmp_path):
    """transformers 4.x wrote ``rope_scaling: {"type": ...}``; a config may also keep both forms."""
    folder = hf_checkpoint(tmp_path / "hf", ROPE_FORMS["linear"])
    expected = hf_logits(folder, tokens(40, 320))

    def both(c):
        c["rope_theta"] = 10000.0
        c["rope_scaling"] = {"type": "linear", "factor": 4.0}

    edit_config(folder, both)
    with torch.no_grad():
        got = loaders.load_hf(folder, LoadOptions()).module(tokens(40, 320))[0]
    assert max_diff(got, expected) <= ATOL


def test_dynamic_rope_beyond_max_position_embeddings_is_refused(tmp_path):
    folder = hf_checkpoint(tmp_path / "hf", ROPE_FORMS["dynamic"])
    assert loaders.load_hf(folder, LoadOptions(max_seq_len=MAX_POS)).module.config.rope_linear_factor == 1.0
    with pytest.raises(LlmcoreError) as e:
        loaders.load_hf(folder, LoadOptions(max_seq_len=2 * MAX_POS))
    assert "dynamic" in str(e.value) and f"--max-seq-len {MAX_POS}" in e.value.fix


def _refusal(folder: Path, change) -> LlmcoreError:
    edit_config(folder, change)
    with pytest.raises(LlmcoreError) as e:
        loaders.load_hf(folder, LoadOptions())
    err = e.value
    assert err.stage == "load" and err.plugin == "llama" and err.fix
    assert "\n" not in str(err) and str(err).startswith("[load/llama] ")
    return err


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
         ["'rope_parameters.rope_type'", "'yarn'"]),
        (lambda c: (legacy_form(c), c.update(rope_scaling={"type": "yarn", "factor": 4.0})),
         ["'rope_scaling.type'", "'yarn'"]),
        (lambda c: c["rope_parameters"].update(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8),
         ["'rope_parameters.rope_type'", "'longrope'"]),
        (lambda c: c["rope_parameters"].update(rope_type="linear", factor=2.0, attention_factor=0.5),
         ["'rope_parameters.attention_factor'"]),
        (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5), ["'rope_parameters.partial_rotary_factor'"]),
        (lambda c: c.update(rope_theta=10000.0), ["'rope_theta'", "rope_parameters.rope_theta"]),
        (lambda c: c.update(attn_logit_softcapping=50.0), ["'attn_logit_softcapping'"]),
        (lambda c: c.update(logits_scaling=2.0), ["'logits_scaling'"]),
        (lambda c: c.update(mlp_bias=True), ["'mlp_bias'"]),
        (lambda c: c.update(hidden_act="gelu"), ["'hidden_act'", "'gelu'"]),
        (lambda c: c.update(quantization_config={"quant_method": "gptq"}), ["'quantization_config'"]),
    ],
    ids=["yarn", "yarn-legacy", "longrope", "rope-extra-key", "partial-rotary", "theta-conflict", "softcapping",
         "unknown-key", "mlp-bias", "hidden-act", "quantized"],
)
def test_computational_keys_are_refused_by_name(tmp_path, change, named):
    folder = hf_checkpoint(tmp_path / "hf", ROPE_FORMS["default"])
    err = _refusal(folder, change)
    for name in named:
        assert name in str(err), str(err)


def test_attention_bias_is_implemented(tmp_path):
    """``attention_bias: true`` gives q/k/v/o biases (transformers' Llama); the q/k biases are
    permuted with their weights into the Meta rotary layout and must still match."""
    folder = hf_checkpoint(tmp_path / "hf", ROPE_FORMS["default"], attention_bias=True)
    ours = loaders.load_hf(folder, LoadOptions()).module
    assert ours.config.qkv_bias and ours.config.o_bias
    for n in LENGTHS:
        toks = tokens(n, 320, seed=n)
        with torch.no_grad():
            diff = max_diff(ours(toks)[0], hf_logits(folder, toks))
        assert diff <= ATOL, f"length {n}: max |diff| {diff}"


def test_harmless_keys_are_accepted(tmp_path):
    folder = hf_checkpoint(tmp_path / "hf", ROPE_FORMS["llama3"])
    expected = hf_logits(folder, tokens(20, 320))
    edit_config(folder, lambda c: c.update(
        pretraining_tp=2, attention_dropout=0.1, initializer_range=0.5, use_cache=False, torch_dtype="bfloat16",
        _name_or_path="x", sliding_window=None, some_future_key=None, temperature=0.7,
    ))
    with torch.no_grad():
        got = loaders.load_hf(folder, LoadOptions()).module(tokens(20, 320))[0]
    assert max_diff(got, expected) <= ATOL


def test_every_key_transformers_writes_is_in_the_table():
    written = set(transformers.LlamaConfig().to_dict())
    assert written <= set(keys.HF_KEYS), sorted(written - set(keys.HF_KEYS))


# config.json of published checkpoints (meta-llama/Llama-3.2-1B, HuggingFaceTB/SmolLM2-135M), as transformers 4.x wrote them
LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536, "is_llama_config": True, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
    "vocab_size": 49152,
}


def test_published_configs_are_read():
    c = loaders.hf_config(LLAMA_32_1B)
    assert c.rope_theta == 500000.0 and c.rope_scaling.factor == 32.0 and c.head_dim == 64 and c.tie_embeddings
    c = loaders.hf_config(SMOLLM2_135M)
    assert c.rope_theta == 100000.0 and c.rope_scaling is None and c.norm_eps == 1e-5
    # the same checkpoints as transformers 5 writes them: rope_parameters instead
    new = dict(LLAMA_32_1B, rope_parameters={**LLAMA_32_1B["rope_scaling"], "rope_theta": 500000.0})
    del new["rope_scaling"], new["rope_theta"]
    assert loaders.hf_config(new) == loaders.hf_config(LLAMA_32_1B)


def test_cli_refuses_yarn_in_one_line(tmp_path):
    folder = hf_checkpoint(tmp_path / "hf", ROPE_FORMS["default"])
    edit_config(folder, lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0,
                                                              original_max_position_embeddings=16))
    out = tmp_path / "x.pte"
    proc = subprocess.run([sys.executable, "-m", "llmcore", "export", "--model", "llama", "--checkpoint", str(folder),
                           "--quiet", "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and not out.exists()
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "[load/llama] config.json key 'rope_parameters.rope_type'" in lines[0] and "'yarn'" in lines[0] and "Fix:" in lines[0], proc.stderr


def test_cli_export_llama3_rope_matches_transformers(tmp_path):
    """One export (they are slow): the .pte, run by the ExecuTorch runtime, against transformers."""
    pytest.importorskip("llmcore_xnnpack")
    from llmcore.runtime import Program
    from llmcore_llama.tokenization import tiny_tokenizer

    folder = hf_checkpoint(tmp_path / "hf", ROPE_FORMS["llama3"])
    (folder / "tokenizer.json").write_text(tiny_tokenizer(320).json_text)
    out = tmp_path / "x.pte"
    proc = subprocess.run([sys.executable, "-m", "llmcore", "export", "--model", "llama", "--checkpoint", str(folder),
                           "--plugins", "xnnpack", "--quiet", "-o", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    program = Program.load(out)
    assert program.max_seq_len == MAX_POS
    worst = 0.0
    for n in LENGTHS:
        toks = tokens(n, 320, seed=n)
        got = program.logits(toks[0].tolist(), 0 if program.use_kv_cache else None)
        worst = max(worst, max_diff(got, hf_logits(folder, toks)))
    assert worst <= ATOL, worst
    print(f"llama3 .pte: max |logit diff| vs transformers {worst:.2e}")


# ---- Meta params.json -----------------------------------------------------------------------


def test_meta_keys(tmp_path):
    sd = meta_state_dict(random_model(TINY))
    write_meta(tmp_path, sd, TINY)
    params = json.loads((tmp_path / "params.json").read_text())
    toks = tokens(30, TINY.vocab_size)

    def with_params(**extra):
        (tmp_path / "params.json").write_text(json.dumps({**params, **extra}))
        return loaders.load_meta(tmp_path, LoadOptions())

    lm = with_params(use_scaled_rope=True, rope_scaling_factor=4.0, rope_high_freq_factor=2.0, max_batch_size=8)
    s = lm.module.config.rope_scaling
    assert (s.factor, s.high_freq_factor, s.low_freq_factor, s.original_max_position_embeddings) == (4.0, 2.0, 1.0, 8192)
    from llmcore_llama.model import rope_inv_freq

    ref = reference_forward(sd, TINY, toks, inv_freq=rope_inv_freq(lm.module.config))
    with torch.no_grad():
        torch.testing.assert_close(lm.module(toks)[0], ref[-1], atol=1e-5, rtol=0)
    for extra, name in (({"use_hf_rope": True}, "'use_hf_rope'"), ({"use_qk_norm": True}, "'use_qk_norm'"),
                        ({"final_logit_softcapping": 30.0}, "'final_logit_softcapping'"),
                        ({"rope_scaling_factor": 8.0, "rope_scale_factor": 4.0, "use_scaled_rope": True},
                         "rope_scale_factor")):
        with pytest.raises(LlmcoreError) as e:
            with_params(**extra)
        assert name in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---- GGUF metadata --------------------------------------------------------------------------


def test_gguf_linear_rope_is_implemented(tmp_path):
    sd = meta_state_dict(random_model(TINY))
    path = tmp_path / "m.gguf"
    write_gguf(path, sd, TINY, metadata=lambda w: (w.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR),
                                                    w.add_rope_scaling_factor(4.0)))
    lm = loaders.load_gguf(path, LoadOptions())
    assert lm.module.config.rope_linear_factor == 4.0
    hd = TINY.resolved_head_dim
    inv_freq = 1.0 / (TINY.rope_theta ** (torch.arange(0, hd, 2).float() / hd)) / 4.0
    toks = tokens(30, TINY.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(lm.module(toks)[0], reference_forward(sd, TINY, toks, inv_freq=inv_freq)[-1],
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "add, named",
    [
        (lambda w, g: (w.add_rope_scaling_type(g.RopeScalingType.YARN), w.add_rope_scaling_factor(4.0)),
         ["'llama.rope.scaling.type'", "'yarn'"]),
        (lambda w, g: w.add_float32("llama.attn_logit_softcapping", 30.0), ["'llama.attn_logit_softcapping'"]),
        (lambda w, g: w.add_bool("llama.attention.causal", False), ["'llama.attention.causal'"]),
        (lambda w, g: w.add_uint32("llama.attention.value_length", 8), ["'llama.attention.value_length'"]),
    ],
    ids=["yarn", "softcapping", "non-causal", "value-length"],
)
def test_gguf_computational_keys_are_refused_by_name(tmp_path, add, named):
    import gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, meta_state_dict(random_model(TINY)), TINY, metadata=lambda w: add(w, gguf))
    with pytest.raises(LlmcoreError) as e:
        loaders.load_gguf(path, LoadOptions())
    assert e.value.plugin == "llama" and "\n" not in str(e.value)
    for name in named:
        assert name in str(e.value), str(e.value)


def test_gguf_harmless_and_default_keys_are_accepted(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, meta_state_dict(random_model(TINY)), TINY,
               metadata=lambda w: (w.add_bool("llama.attention.causal", True), w.add_rope_scaling_finetuned(True)))
    assert loaders.load_gguf(path, LoadOptions()).module.config.rope_linear_factor == 1.0


# ---- llama2.c -------------------------------------------------------------------------------


def test_llama2c_with_other_rope_tables_is_refused(tmp_path):
    """A legacy llama2.c file stores its RoPE tables; ones from another base are refused."""
    path = tmp_path / "stories.bin"
    loaders.write_llama2c(random_model(replace(TINY, rope_theta=500000.0, tie_embeddings=True)), path, version=0)
    with pytest.raises(LlmcoreError) as e:
        loaders.load_llama2c(path, LoadOptions())
    assert "freq_cis" in str(e.value) and "10000" in str(e.value)
