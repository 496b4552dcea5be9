"""`llmcore matrix` on a local Ray against the same cells one after another in one process.

Not a test. Both sides export the same cells through the same function (the one a Ray
worker runs, :func:`llmcore.apps.matrix.export_cell`), on this machine, in this run:

- **Ray**: ``llmcore matrix`` as a user runs it (a fresh output folder, local Ray with one
  worker per core, a fresh worker process per cell), wall time of the whole command;
- **one process**: every cell in turn in this benchmark's process (imports paid once).

The default matrix is the tiny one of the tests (2 families x 2 backend orders x 2
recipes; the two cells XNNPACK's recipe cannot take on the portable runtime fail at once on
both sides). ``--smollm2`` adds SmolLM2-135M from its GGUF with three XNNPACK recipes.
Run nothing else while it runs.

    .venv/bin/python benchmarks/bench_matrix.py [--smollm2] [--rounds N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import machine_header, smollm2_path  # noqa: E402

TINY = {
    "common": {"max-seq-len": 64},
    "models": [{"model": "nanogpt", "config": "tiny"}, {"name": "tiny-llama", "model": "llama", "config": "tiny"}],
    "backends": ["xnnpack", []],
    "recipes": ["none", "int8-dynamic"],
}


def smollm2_matrix() -> dict:
    return {
        "common": {"max-seq-len": 1024},
        "models": [{"name": "smollm2", "checkpoint": smollm2_path()}],
        "backends": ["xnnpack"],
        "recipes": ["gguf", "8da4w", "int8-dynamic"],
    }


def run_ray(matrix_file: Path, output: Path) -> tuple[float, dict]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "llmcore", "matrix", str(matrix_file), "--output", str(output)],
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1):  # 1: some cells failed, as expected here
        sys.exit(f"llmcore matrix failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    cells = json.loads((output / "matrix.json").read_text())["cells"]
    return wall, {c["cell"]: c for c in cells}


def run_in_process(matrix_file: Path, output: Path) -> tuple[float, dict]:
    from llmcore.apps.matrix import check_cell, export_cell, load_matrix
    from llmcore.plugins import load_registry

    start = time.perf_counter()
    matrix = load_matrix(str(matrix_file), root=str(output))
    registry = load_registry()
    cells = {}
    for cell in matrix.cells:
        problem = check_cell(cell, registry)
        if problem:
            cells[cell.name] = {"status": "failed", "wall_s": 0.0}
            continue
        result = export_cell(dataclasses.asdict(cell.options), None)
        cells[cell.name] = {"status": result["status"], "wall_s": result["wall_s"]}
    return time.perf_counter() - start, cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smollm2", action="store_true", help="add SmolLM2-135M x 3 recipes")
    parser.add_argument("--rounds", type=int, default=1, help="repeat both sides (min and median reported)")
    args = parser.parse_args()
    from tabulate import tabulate

    from llmcore.cli import _quiet_libraries

    _quiet_libraries(debug=False)  # the in-process exports' library chatter, as the CLI quiets it
    matrices = [("tiny", TINY)] + ([("smollm2", smollm2_matrix())] if args.smollm2 else [])
    print(machine_header())
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-matrix-") as tmp:
        for label, data in matrices:
            matrix_file = Path(tmp) / f"{label}.yaml"
            matrix_file.write_text(yaml.safe_dump(data))
            ray_walls, seq_walls, seq_cells = [], [], {}
            for i in range(args.rounds):
                wall, ray_cells = run_ray(matrix_file, Path(tmp) / f"ray-{label}-{i}")
                ray_walls.append(wall)
                wall, seq_cells = run_in_process(matrix_file, Path(tmp) / f"seq-{label}-{i}")
                seq_walls.append(wall)
            exported = [n for n, c in seq_cells.items() if c["status"] == "ok"]
            assert all(ray_cells[n]["status"] == "ok" for n in exported), ray_cells
            cell_sum = sum(seq_cells[n]["wall_s"] for n in exported)
            print(f"\n{label}: {len(seq_cells)} cells, {len(exported)} exported; "
                  f"sum of the exports' own wall time in one process {cell_sum:.1f}s")
            for name in exported:
                print(f"  {name:40s} one process {seq_cells[name]['wall_s']:6.1f}s   "
                      f"Ray worker {ray_cells[name]['wall_s']:6.1f}s, peak {ray_cells[name]['peak_rss_mib']:.0f} MiB")
            rows.append([label, len(exported), f"{min(ray_walls):.1f} / {statistics.median(ray_walls):.1f}",
                         f"{min(seq_walls):.1f} / {statistics.median(seq_walls):.1f}",
                         f"{statistics.median(seq_walls) / statistics.median(ray_walls):.2f}x"])
    print()
    print(tabulate(rows, headers=["matrix", "cells exported", "Ray wall s (min / median)",
                                  "one process wall s (min / median)", "Ray speed-up (median)"]))


if __name__ == "__main__":
    main()
