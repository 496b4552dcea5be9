"""Size and start-up of C++ runner builds: the binary plus every shared library ``ldd``
resolves for it, and the wall time of loading a program and exiting (``--max-new-tokens 0``,
median of 7). Compares runners built against different ExecuTorch wheels. A runner whose
greedy tokens on the program are not the Python runtime's is refused, not measured.

    .venv/bin/python benchmarks/runner_footprint.py PROGRAM.pte new=build/llmcore_runner old=OLD/llmcore_runner
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time

# Libraries that mean the runner drags in Python or PyTorch.
HEAVY = re.compile(r"libpython|libtorch|libc10|_portable_lib|\b_C\.cpython|aot_lib")


def footprint(path: str) -> tuple[int, list[str]]:
    libs = set()
    for line in subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout.splitlines():
        found = re.search(r"=> (\S+)", line)
        if found and os.path.exists(found.group(1)):
            libs.add(os.path.realpath(found.group(1)))
    return sum(os.path.getsize(lib) for lib in libs), sorted(libs)


def start_up_s(runner: str, pte: str, rounds: int = 7) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        subprocess.run([runner, pte, "--prompt", "Hello", "--max-new-tokens", "0"], capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    from llmcore.runtime.agreement import check

    pte = argv[0]
    for spec in argv[1:]:
        label, _, runner = spec.rpartition("=")
        # A runner that loads fast and answers wrongly is not measured (llmcore/runtime/agreement.py).
        (agreement,) = check(pte, runner, "Hello", 16)
        if not agreement.agrees:
            print(f"{label or runner}: refused, its tokens are not Python's: {agreement.line()}")
            continue
        libs_bytes, libs = footprint(runner)
        heavy = sorted({os.path.basename(lib) for lib in libs if HEAVY.search(os.path.basename(lib))})
        times = start_up_s(runner, pte)
        print(f"{label or runner}: binary {os.path.getsize(runner) / 1e6:.2f} MB + {len(libs)} shared libraries "
              f"{libs_bytes / 1e6:.1f} MB (Python/PyTorch ones: {', '.join(heavy) or 'none'}); load and exit: "
              f"median {1000 * statistics.median(times):.0f} ms (min {1000 * min(times):.0f}, max {1000 * max(times):.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
