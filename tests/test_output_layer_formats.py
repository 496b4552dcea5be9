"""benchmarks/int4_gemm_probe/output_layer_formats.py: the Q6_K and int8-row GEMVs it times
are checked against their reference first, and it prints a line per format and their ratio."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "int4_gemm_probe" / "output_layer_formats.py"


def test_a_small_run_prints_both_formats():
    done = subprocess.run([sys.executable, str(SCRIPT), "--rows", "67", "--cols", "512", "--calls", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "# cpu:" in done.stdout and "Q6_K / int8 rows: time" in done.stdout
    assert "bytes 0.8" in done.stdout  # 210 bytes a super-block against 256 and a scale a row


def test_widths_off_the_super_block_are_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--cols", "300"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "multiple of 256" in done.stderr

