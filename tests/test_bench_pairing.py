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
