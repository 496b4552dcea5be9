"""benchmarks/bench_scale.py measures each process's own peak memory, not the bench's: a
child inherits its parent's high-water mark until exec, so a plain ``wait4`` on a child of
a large process reports at least that process's size."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_scale  # noqa: E402

ALLOCATE = "import sys; block = bytearray(int(sys.argv[1]) * 2**20); block[::4096] = b'x' * len(block[::4096])"


def test_peak_is_the_childs_own_while_the_parent_holds_more():
    held = bytearray(600 * 2**20)
    held[::4096] = b"y" * len(held[::4096])  # resident in the bench's process
    status, _, small, _, _ = bench_scale.run_with_peak([sys.executable, "-c", ALLOCATE, "50"])
    status_big, _, big, _, _ = bench_scale.run_with_peak([sys.executable, "-c", ALLOCATE, "250"])
    del held
    assert status == 0 and status_big == 0
    assert 50 < small < 200, small  # the interpreter and its 50 MiB, not the 600 MiB held here
    assert 240 < big - small + 50 < 300, (small, big)


def test_exit_status_and_input_reach_the_caller():
    status, _, _, out, err = bench_scale.run_with_peak(
        [sys.executable, "-c", "import sys; print(sys.stdin.read().upper()); sys.exit(3)"], stdin="tokens")
    assert status == 3 and out.strip() == "TOKENS" and err == ""


def test_python_over_cpp_is_paired_by_round_and_leaves_refused_rounds_out():
    # a slow second round slows both sides: Python is 0.9x the runner in each round
    cpp = [{"prefill_tok_s": 100.0, "decode_tok_s": 200.0}, {"prefill_tok_s": 50.0, "decode_tok_s": 100.0},
           {"prefill_tok_s": 100.0, "decode_tok_s": 200.0, "refused": "tokens differ"}]
    python = [{"prefill_tok_s": 90.0, "decode_tok_s": 180.0}, {"prefill_tok_s": 45.0, "decode_tok_s": 90.0},
              {"prefill_tok_s": 10.0, "decode_tok_s": 10.0}]
    ratios = bench_scale.paired_ratios(python, cpp, python[:1], cpp[:1])
    assert ratios == {"prefill": 0.9, "prefill_long": 0.9, "decode": 0.9}
    assert bench_scale.paired_ratios(python[2:], cpp[2:], [], [])["decode"] is None
