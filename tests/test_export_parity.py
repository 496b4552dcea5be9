"""An exported .pte, run by the ExecuTorch runtime, against eager PyTorch.

One export per variant, each run at three sequence lengths (dynamic shapes), and, for
KV-cache programs, a prefill followed by a decode step. The eager reference is always
the plain model recomputing the whole sequence. Bounds:
* fp32 (portable, XNNPACK, with or without a cache): max |logit difference| <= 1e-4
  (observed ~1e-5);
* XNNPACK int8-dynamic: max |diff| <= 0.05 with the same argmax (observed ~0.006 on the
  tiny model, whose logits span about +-1).
"""

from __future__ import annotations

import pytest
import torch

from llmcore.runtime import Program
from llmcore_nanogpt.model import CONFIGS, GPT

LENGTHS = (1, 17, 128)
BOUNDS = {"portable": 1e-4, "xnnpack": 1e-4, "int8": 0.05, "nocache": 1e-4, "static-cache": 1e-4}
VARIANTS = list(BOUNDS)


def eager_tiny() -> GPT:
    return GPT(CONFIGS["tiny"]).init_random(0).eval()


def _close(variant, got, expected, where):
    diff = (got - expected).abs().max().item()
    assert diff <= BOUNDS[variant], f"{variant} {where}: max diff {diff}"
    assert int(got.argmax()) == int(expected.argmax()), f"{variant} {where}: argmax differs"


@pytest.mark.parametrize("variant", VARIANTS)
def test_pte_matches_eager_at_three_lengths(exports, variant):
    program = Program.load(exports(variant).pte)
    model = eager_tiny()
    gen = torch.Generator().manual_seed(1)
    assert program.max_seq_len == 128
    assert program.use_kv_cache == (variant != "nocache")
    for length in LENGTHS:
        tokens = torch.randint(0, 257, (1, length), generator=gen)
        with torch.no_grad():
            expected = model(tokens)[0]
        got = program.logits(tokens[0].tolist(), 0 if program.use_kv_cache else None)
        _close(variant, got, expected, f"length {length}")


def test_a_mapped_program_computes_what_a_read_one_does(exports):
    """``Program.load`` reads a file into huge pages by default and maps it with
    ``map_file=True`` (``--mmap``): where the bytes live, not what they compute."""
    from llmcore.runtime.program_bytes import in_huge_pages

    tokens = list(range(3, 40))
    pte = exports("xnnpack").pte
    read = Program.load(pte).logits(tokens, 0)
    mapped = Program.load(pte, map_file=True).logits(tokens, 0)
    assert torch.equal(torch.as_tensor(read), torch.as_tensor(mapped))
    assert in_huge_pages(b"too small for a huge page") is False


@pytest.mark.parametrize("variant", ["xnnpack", "int8", "static-cache"])
def test_kv_cache_decode_steps_match_full_recompute(exports, variant):
    program = Program.load(exports(variant).pte)
    model = eager_tiny()
    tokens = torch.randint(0, 257, (1, 24), generator=torch.Generator().manual_seed(2))
    program.logits(tokens[0, :16].tolist(), 0)
    for pos in range(16, 24):
        got = program.logits([int(tokens[0, pos])], pos)
        with torch.no_grad():
            expected = model(tokens[:, : pos + 1])[0]
        _close(variant, got, expected, f"decode at {pos}")


def _forward_operators(pte_path) -> set[str]:
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(pte_path.read_bytes())
    program = getattr(program, "program", program)
    plan = next(p for p in program.execution_plan if p.name == "forward")
    return {op.name for op in plan.operators}


def test_custom_op_cache_uses_executorch_llm_ops(exports):
    ops = _forward_operators(exports("xnnpack").pte)
    assert {"llama::update_cache", "llama::custom_sdpa"} <= ops


def test_plain_pytorch_cache_writes_in_place(exports):
    # index_put_ (in place) and no functional index_put + copy_ of the whole cache.
    ops = _forward_operators(exports("static-cache").pte)
    assert "aten::index_put_" in ops
    assert "aten::index_put" not in ops and "aten::copy_" not in ops
    assert not any(op.startswith("llama::") for op in ops)


def test_report_records_delegation_and_parity(exports):
    report = exports("int8").report
    delegation = report["delegation"]
    assert delegation["delegated_nodes"] > 0
    assert "XnnpackBackend" in delegation["by_backend"]
    assert any("linear" in op for op in delegation["by_backend"]["XnnpackBackend"]["operators"])
    assert report["parity"]["top1_agreement"] == 1.0
    assert report["parity"]["max_abs_diff"] < 0.05
    assert report["quantization"]["recipe"] == "int8-dynamic"
    assert report["transforms"] == ["split-qkv", "xnnpack-norms", "kv-cache"]
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
    meta = Program.load(exports("xnnpack").pte).metadata
    assert meta["get_max_seq_len"] == 128 and meta["get_max_context_len"] == 128
    assert meta["get_vocab_size"] == 257
    assert meta["get_eos_ids"] == [256]
    assert meta["use_kv_cache"] is True and meta["use_sdpa_with_kv_cache"] is True
    assert meta["enable_dynamic_shape"] is True
    nocache = Program.load(exports("nocache").pte).metadata
    assert nocache["use_kv_cache"] is False and nocache["use_sdpa_with_kv_cache"] is False


@pytest.mark.parametrize("tie_margin, counted", [(+1e-3, True), (-1e-3, False)], ids=["within", "beyond"])
def test_parity_names_a_disagreement_on_a_near_tie(exports, monkeypatch, tie_margin, counted):
    """A reference whose top-1 is the program's second token disagrees; it is reported as a
    near tie when the program holds the two within NEAR_TIE_LOGITS, and only then."""
    from llmcore.pipeline import parity
    from llmcore.pipeline.report import format_summary

    pte = exports("xnnpack").pte
    ids = list(range(3, 20))
    got = torch.as_tensor(Program.load(pte).logits(ids, 0)).float()
    first, second = torch.topk(got, 2).indices.tolist()
    gap = float(got[first] - got[second])
    reference = got.clone()
    reference[second] = got[first] + 1.0  # the reference prefers the program's runner-up
    monkeypatch.setattr(parity, "NEAR_TIE_LOGITS", gap + tie_margin)
    result = parity.check_parity(str(pte), [parity.ReferenceCall(ids, 0, reference)], "test")
    assert result.top1_agreement == 0.0
    assert result.near_ties == int(counted)
    assert (result.near_tie_gap == pytest.approx(gap, abs=1e-5)) if counted else result.near_tie_gap is None
    # how sure the reference was: it holds its top-1 1.0 above the program's, and the call's
    # largest difference is the runner-up's, gap + 1
    assert result.disagreements == [{"length": len(ids), "reference_margin": pytest.approx(1.0, abs=1e-5),
                                     "max_abs_diff": pytest.approx(gap + 1.0, abs=1e-5)}]
    line = format_summary({"parity": result.as_dict(), "outputs": {"pte": "x.pte", "pte_bytes": 1}, "stages": []})
    assert ("near tie" in line) == counted, line
    assert "ranks the program's top-1 at most 1 below its own" in line, line
