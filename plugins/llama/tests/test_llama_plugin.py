"""The plugin's hook, its records and random-init configs."""

import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

from llmcore.errors import LlmcoreError
from llmcore.records import LoadOptions, ModelFamily


def test_hook_returns_the_llama_family():
    import llmcore_llama

    (family,) = llmcore_llama.llmcore_model_families()
    assert isinstance(family, ModelFamily) and family.name == "llama"
    assert set(family.configs) == {"tiny", "smollm2-135m"} and family.default_config == "tiny"
    assert [l.name for l in family.loaders] == ["gguf", "hf", "meta", "llama2c"]


def test_entry_point_is_registered():
    eps = [ep for ep in entry_points(group="llmcore") if ep.name == "llama"]
    if not eps:
        pytest.skip("llmcore-llama is not pip-installed in this environment")
    assert eps[0].value == "llmcore_llama"


def test_listing_the_plugin_does_not_import_torch():
    code = "import sys, llmcore_llama; llmcore_llama.llmcore_model_families(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_build_random_tiny():
    from llmcore_llama import build_random

    lm = build_random("tiny", LoadOptions(seed=3))
    md = lm.metadata
    assert (md.vocab_size, md.max_seq_len, md.bos_id, md.n_bos) == (320, 128, 317, 1)
    assert md.eos_ids == (318, 319) and lm.source == "random:tiny" and lm.family == "llama"
    assert lm.tokenizer is not None and '"type": "BPE"' in lm.tokenizer.json_text
    with torch.no_grad():
        a = lm.module(torch.tensor([[1, 2, 3]]))
        b = build_random("tiny", LoadOptions(seed=3)).module(torch.tensor([[1, 2, 3]]))
        c = build_random("tiny", LoadOptions(seed=4)).module(torch.tensor([[1, 2, 3]]))
    assert a.shape == (1, 320) and torch.equal(a, b) and not torch.equal(a, c)


def test_build_random_smollm2_shape():
    from llmcore_llama import build_random

    lm = build_random("smollm2-135m", LoadOptions(max_seq_len=256))
    n = sum(p.numel() for p in lm.module.parameters())
    assert 134_000_000 < n < 135_000_000  # 134.5M with tied embeddings
    assert lm.metadata.max_seq_len == 256 and lm.metadata.vocab_size == 49152


def test_unknown_config_lists_choices():
    from llmcore_llama import build_random

    with pytest.raises(LlmcoreError) as e:
        build_random("huge", LoadOptions())
    assert "tiny" in e.value.fix and e.value.stage == "load"


def test_each_layer_lowers_to_one_xnnpack_delegate(tmp_path):
    """Norms, RoPE and the head views stay inside XNNPACK: the only breaks in a layer are
    the KV-cache ops, so a 2-layer model has at most one delegate per layer plus the
    ends (it had 11 when the 3-D mean and RoPE's channel selects split every layer)."""
    import json

    pytest.importorskip("llmcore_xnnpack")
    out = tmp_path / "tiny.pte"
    subprocess.run([sys.executable, "-m", "llmcore", "export", "--model", "llama", "--config", "tiny",
                    "--plugins", "xnnpack", "--quiet", "-o", str(out)], check=True, capture_output=True)
    report = json.loads(out.with_suffix(".report.json").read_text())
    delegated = {row["op_type"]: row["delegated"] for row in report["delegation"]["operators"]}
    not_delegated = {row["op_type"]: row["not_delegated"] for row in report["delegation"]["operators"]}
    assert report["delegation"]["delegated_subgraphs"] <= 2 + 2, report["delegation"]
    assert not_delegated.get("aten_mean_dim", 0) == 0 and delegated["aten_mean_dim"] == 5  # 2 x 2 + final norm
    assert not_delegated.get("aten_mul_tensor", 0) == 0 and not_delegated.get("aten_mm_default", 0) == 0
    assert report["parity"]["top1_agreement"] == 1.0


def test_export_without_kv_cache_lowers(tmp_path):
    """Without a cache, the attention's mask and GQA ops stay outside XNNPACK between q's
    and k's RoPE; the export must still partition without a dependency cycle."""
    import json

    pytest.importorskip("llmcore_xnnpack")
    out = tmp_path / "nocache.pte"
    subprocess.run([sys.executable, "-m", "llmcore", "export", "--model", "llama", "--config", "tiny",
                    "--plugins", "xnnpack", "--skip-transforms", "kv-cache", "--quiet", "-o", str(out)],
                   check=True, capture_output=True)
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert report["parity"]["top1_agreement"] == 1.0 and report["parity"]["max_abs_diff"] < 1e-4
