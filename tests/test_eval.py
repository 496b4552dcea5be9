"""llmcore eval: perplexity of a program and of its eager model, on the shipped text."""

from __future__ import annotations

import json
import math

from clitools import ROOT

TEXT = ROOT / "benchmarks" / "data" / "alice-chapter1.txt"


def test_eval_prints_both_perplexities_fp32_agrees(exports, cli):
    pte = exports("xnnpack").pte
    result = cli("eval", str(pte), "--text", str(TEXT), "--max-tokens", "80", "--window", "32", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    program, eager = data["program"], data["eager"]
    assert program["tokens_scored"] == eager["tokens_scored"] == 79
    # Random weights over a 257-token vocabulary: perplexity near the vocabulary size.
    assert 100 < eager["perplexity"] < 600
    assert abs(data["delta_pct"]) < 0.01  # fp32 program: the same model


def test_eval_of_int8_program_shows_a_small_cost(exports, cli):
    pte = exports("int8").pte
    result = cli("eval", str(pte), "--text", str(TEXT), "--max-tokens", "48", "--json")
    data = json.loads(result.stdout)
    assert math.isfinite(data["delta"]) and abs(data["delta_pct"]) < 2.0


def test_eval_text_output(exports, cli):
    result = cli("eval", str(exports("xnnpack").pte), "--text", str(TEXT), "--max-tokens", "20", "--no-eager")
    assert result.returncode == 0 and "program  perplexity" in result.stdout


def test_eval_refuses_a_program_without_cache(exports, cli):
    result = cli("eval", str(exports("nocache").pte), "--text", str(TEXT))
    assert result.returncode == 2 and "has none" in result.stderr
