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


def test_each_round_starts_with_its_own_measurement_before_the_targets_run():
    """The bandwidth is measured at the start of every round (bench_decode's bw limits take
    the median of those), so a measurement and the round it stands for sit side by side."""
    events = []

    def target(name):
        def run():
            events.append(name)
            return {"prefill_tok_s": 1.0, "decode_tok_s": 1.0}
        return run

    bench_decode.measure([({"variant": "a"}, "c++", target("a")), ({"variant": "b"}, "c++", target("b"))], 3,
                         each_round=lambda: events.append("start"))
    assert events == ["start", "a", "b"] * 3


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



def test_a_runner_row_whose_tokens_are_not_pythons_is_refused_and_not_printed(capsys):
    """Issue 58: the bench timed a runner that printed blank lines. A runner row is kept only
    when the Python runtime, following its tokens, finds each one its own choice (up to a
    near tie): ``follow`` stands in for that check here (tests/test_agreement.py tests it)."""
    rows = [{"variant": "gguf", "runner": "python"},
            {"variant": "gguf", "runner": "c++", "ids": [198, 198]},
            {"variant": "gguf", "runner": "c++ old", "ids": [5, 6]},
            {"variant": "8da4w", "runner": "c++", "ids": None},
            {"variant": "llama.cpp Q4_0", "runner": "llama-bench"}]
    verdicts = {"c++": {"agrees": False, "line": "gguf (c++): its token at step 0 of 2 (198) scores 3 logits below"},
                "c++ old": {"agrees": True, "line": "gguf (c++ old): each of its 2 tokens is Python's choice"}}
    kept = bench_decode.refuse_wrong_rows(rows, follow=lambda r: verdicts[r["runner"]])
    assert [(r["variant"], r["runner"]) for r in kept] == [("gguf", "python"), ("gguf", "c++ old"),
                                                           ("llama.cpp Q4_0", "llama-bench")]
    err = capsys.readouterr().err
    assert "row refused, its tokens are not Python's: gguf (c++): its token at step 0" in err
    assert "row refused, its tokens are not Python's: the runner printed no ids" in err
    assert rows[1]["refused"].startswith("gguf (c++)")
