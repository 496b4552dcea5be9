"""An exported .pte, run by the ExecuTorch runtime, against eager PyTorch.

One export per variant, run at three sequence lengths (dynamic shapes). Bounds:
* portable and XNNPACK fp32: max |logit difference| <= 1e-4 (observed ~1e-5);
* XNNPACK int8-dynamic: against the fp32 eager model, max |diff| <= 0.05 with the same
  argmax at every length (observed ~0.006 on the tiny model, whose logits span about +-1).
"""

from __future__ import annotations

import pytest
import torch

from llmcore.runtime import Program
from llmcore_nanogpt.model import CONFIGS, GPT

LENGTHS = (1, 17, 128)
BOUNDS = {"portable": 1e-4, "xnnpack": 1e-4, "int8": 0.05}


def eager_tiny() -> GPT:
    return GPT(CONFIGS["tiny"]).init_random(0).eval()


@pytest.mark.parametrize("variant", ["portable", "xnnpack", "int8"])
def test_pte_matches_eager_at_three_lengths(exports, variant):
    result = exports(variant)
    program = Program.load(result.pte)
    model = eager_tiny()
    gen = torch.Generator().manual_seed(1)
    assert program.max_seq_len == 128 and not program.use_kv_cache
    for length in LENGTHS:
        tokens = torch.randint(0, 257, (1, length), generator=gen)
        with torch.no_grad():
            expected = model(tokens)[0]
        got = program.logits(tokens[0].tolist())
        diff = (got - expected).abs().max().item()
        assert diff <= BOUNDS[variant], f"{variant} at length {length}: max diff {diff}"
        assert int(got.argmax()) == int(expected.argmax())


def test_report_records_delegation_and_parity(exports):
    report = exports("int8").report
    delegation = report["delegation"]
    assert delegation["delegated_nodes"] > 0
    assert "XnnpackBackend" in delegation["by_backend"]
    assert any("linear" in op for op in delegation["by_backend"]["XnnpackBackend"]["operators"])
    assert report["parity"]["top1_agreement"] == 1.0
    assert report["parity"]["max_abs_diff"] < 0.05
    assert report["quantization"]["recipe"] == "int8-dynamic"
    stages = [s["name"] for s in report["stages"]]
    assert stages[:3] == ["load", "transform", "export"] and "lower" in stages and stages[-1] == "write"
    assert all(s["peak_rss_mib"] > 0 for s in report["stages"])


def test_int8_program_is_smaller(exports):
    fp32 = exports("xnnpack").report["outputs"]["pte_bytes"]
    int8 = exports("int8").report["outputs"]["pte_bytes"]
    assert int8 < 0.6 * fp32


def test_portable_program_has_no_delegates(exports):
    report = exports("portable").report
    assert report["delegation"]["delegated_nodes"] == 0
    assert report["backends"] == []


def test_metadata_methods(exports):
    program = Program.load(exports("xnnpack").pte)
    meta = program.metadata
    assert meta["get_max_seq_len"] == 128
    assert meta["get_vocab_size"] == 257
    assert meta["get_eos_ids"] == [256]
    assert meta["use_kv_cache"] is False
    assert meta["enable_dynamic_shape"] is True
