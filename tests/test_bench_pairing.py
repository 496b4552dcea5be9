"""benchmarks/bench_decode.py's rounds: which round each figure came from, and the paired ratios
taken from them (a row's rate over another's in the same round, the median over rounds)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_decode  # noqa: E402


def scripted(rates: list[tuple[float, float] | None]):
    """A target whose round i reports rates[i] as (prefill, decode), or fails where None."""
    calls = iter(rates)

    def run():
        rate = next(calls)
        if rate is None:
            raise subprocess.CalledProcessError(1, "runner", stderr="killed")
        return {"prefill_tok_s": rate[0], "decode_tok_s": rate[1]}

    return run


def test_a_failed_round_leaves_the_other_rounds_paired_with_their_own():
    ours = scripted([(100.0, 20.0), None, (90.0, 30.0), (120.0, 24.0)])
    peer = scripted([(50.0, 10.0), (80.0, 16.0), (60.0, 10.0), (40.0, 12.0)])
    rows = bench_decode.measure([({"variant": "ours"}, "c++", ours), ({"variant": "peer"}, "c++", peer)], 4)
    mine, theirs = rows
    assert mine["rounds"] == [0, 2, 3] and theirs["rounds"] == [0, 1, 2, 3]
    # rounds 0, 2, 3: decode 20/10, 30/10, 24/12 -> 2, 3, 2; prefill 2, 1.5, 3
    assert bench_decode.paired_ratio(mine, theirs, "decode") == pytest.approx(2.0)
    assert bench_decode.paired_ratio(mine, theirs, "prefill") == pytest.approx(2.0)
    # not the ratio of the medians (decode 24 / 11), which mixes rounds of different speeds
    assert mine["decode_tok_s"] / theirs["decode_tok_s"] != pytest.approx(2.0)


def test_no_round_in_common_gives_no_ratio():
    mine = {"rounds": [0], "decode_runs": [10.0]}
    theirs = {"rounds": [1], "decode_runs": [5.0]}
    assert bench_decode.paired_ratio(mine, theirs, "decode") is None


def test_target_verdicts_read_the_paired_figures_of_the_default_rows():
    rows = [
        {"variant": "8da4w-layers", "runner": "c++", "decode_paired_x_llama_cpp": 1.25, "prefill_paired_x_llama_cpp": 1.9},
        {"variant": "8da4w-layers", "runner": "python", "decode_paired_x_llama_cpp": 1.1,
         "prefill_paired_x_llama_cpp": 2.1, "decode_paired_x_runner": 0.96, "prefill_paired_x_runner": 0.9},
        {"variant": "8da4w-layers", "runner": "c++ old", "decode_paired_x_llama_cpp": 3.0},  # --also-runner: not a target row
        {"variant": "8da8w", "runner": "c++", "of_bw_limit": 0.85, "decode_paired_x_llama_cpp": 0.8},
        {"variant": "fp32", "runner": "c++", "decode_paired_x_llama_cpp": 0.5},  # no target for fp32
        {"variant": "llama.cpp Q4_0", "runner": "llama-bench"},
    ]
    verdicts = {(what, row): (figure, verdict) for what, row, figure, verdict in bench_decode.target_verdicts(rows)}
    assert verdicts == {
        ("decode >= 1.2x Q4_0", "8da4w-layers (c++)"): ("1.25x", "met"),
        ("decode >= 1.2x Q4_0", "8da4w-layers (python)"): ("1.10x", "MISSED"),
        ("prefill >= 2x Q4_0", "8da4w-layers (c++)"): ("1.90x", "MISSED"),
        ("prefill >= 2x Q4_0", "8da4w-layers (python)"): ("2.10x", "met"),
        ("int8 decode >= 80% of bw limit", "8da8w (c++)"): ("85%", "met"),
        ("Python decode within 5% of c++", "8da4w-layers (python)"): ("0.96x", "met"),
        ("Python prefill within 5% of c++", "8da4w-layers (python)"): ("0.90x", "MISSED"),
    }


def test_a_program_inside_the_cache_is_not_judged_against_the_bandwidth_limit():
    row = {"variant": "8da8w-layers", "runner": "c++", "of_bw_limit": 0.5, "file_mib": 238.5}
    assert bench_decode.target_verdicts([row], cache_mib=32.0)[0][3] == "MISSED"
    assert bench_decode.target_verdicts([row], cache_mib=300.0)[0][3].startswith("not judged")
