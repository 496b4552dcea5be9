"""`llmcore matrix`: expansion, refusals, and real runs on a local Ray with 2 workers.

The runs go through the CLI as a subprocess, as a user runs them: a matrix interrupted
with Ctrl-C and run again (it resumes: finished cells are skipped, nothing half-written is
left), a worker killed mid-export (Ray retries the cell), a cell whose checkpoint is
broken beside a good one. Every program made is run and compared with the eager model
rebuilt from its report.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from clitools import LLMCORE, read_json, run_cli
from llmcore.errors import LlmcoreError
from llmcore.apps.matrix import TASK_PREFIX, content_key, expand, installed_versions
from llmcore.recipe import ExportOptions


FAMILIES = [{"model": "nanogpt", "config": "tiny"}, {"name": "tiny-llama", "model": "llama", "config": "tiny"}]
MATRIX = {
    "common": {"max-seq-len": 64},
    "models": FAMILIES,
    "backends": ["xnnpack", []],
    "recipes": ["none", "int8-dynamic"],
}
# int8-dynamic is XNNPACK's recipe: on the portable runtime those two cells fail, the rest go on
UNSUPPORTED = {"nanogpt-tiny/portable/int8-dynamic", "tiny-llama/portable/int8-dynamic"}


def write_matrix(folder: Path, data: dict) -> Path:
    path = folder / "matrix.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def leftovers(root: Path) -> list[Path]:
    """Anything half-written: staged files, or a program without its report."""
    partial = [p for p in root.rglob("*") if p.name.endswith(".partial")]
    orphans = [p for p in root.rglob("*.pte") if not p.with_name(p.stem + ".report.json").is_file()]
    return partial + orphans


def ray_workers(cell: str) -> list[int]:
    """Pids of Ray worker processes exporting ``cell`` (their title is ray::llmcore-export:CELL)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode()
        except (OSError, ValueError):
            continue
        if proc.name.isdigit() and title.startswith(f"ray::{TASK_PREFIX}{cell}"):
            pids.append(int(proc.name))
    return pids


def scratch_folders(pid: int) -> list[Path]:
    """The scratch folders a matrix worker with this pid has left (export_cell makes one per cell)."""
    return list(Path(tempfile.gettempdir()).glob(f"llmcore-matrix-{pid}-*"))


def check_program_runs(report_path: Path) -> None:
    """The program answers the way the eager model rebuilt from its report does."""
    from llmcore.apps.evaluate import eager_reference
    from llmcore.runtime import Program

    report = read_json(report_path)
    program = Program.load(report["outputs"]["pte"])
    ids = [1, 5, 9, 2, 7, 3]
    got = program.logits(ids, 0)
    want = eager_reference(report)(ids, 0)
    assert got.shape == want.shape
    # fp32 programs match to rounding; int8-dynamic ones are compared with the fp32 model
    tolerance = 1e-3 if report["quantization"] is None else 0.05 * float(want.abs().max())
    assert float((got - want).abs().max()) < tolerance, report_path
    assert int(got.argmax()) == int(want.argmax())


# ---- expansion and refusals (no Ray) -----------------------------------------------------


def test_expansion_is_models_by_backends_by_recipes(tmp_path):
    matrix = expand(dict(MATRIX, output=str(tmp_path)))
    names = [c.name for c in matrix.cells]
    assert names == [
        f"{m}/{b}/{r}"
        for m in ("nanogpt-tiny", "tiny-llama")
        for b in ("xnnpack", "portable")
        for r in ("none", "int8-dynamic")
    ]
    cell = matrix.cells[1]
    assert cell.options.plugins == ["xnnpack"] and cell.options.quantize == "int8-dynamic"
    assert cell.options.max_seq_len == 64 and cell.options.model == "nanogpt"
    assert Path(cell.options.output) == tmp_path / "nanogpt-tiny/xnnpack/int8-dynamic.pte"


@pytest.mark.parametrize(
    "change, words",
    [
        ({"modles": []}, "unknown key 'modles'"),
        ({"models": [{"model": "nanogpt", "max-seq-length": 8}]}, "unknown key 'max-seq-length'"),
        ({"recipes": [{"quantize": "int8-dynamic", "output": "x.pte"}]}, "sets 'output'"),
        ({"models": [{"model": "nanogpt", "plugins": ["xnnpack"]}]}, "sets 'plugins'"),
        ({"layout": "{model}/{recipe}.pte"}, "leaves out ['backends']"),
        ({"layout": "{model}/{backends}/{recipe}/{date}.pte"}, "names ['date']"),
        ({"recipes": ["none", {"quantize": "int8-dynamic", "name": "none"}]}, "both write"),
        ({"recipes": [{"quantize": "none", "config": "tiny"}]}, "both set 'config'"),
        ({"backends": [["xnnpack", 3]]}, "each entry of 'backends'"),
        ({"models": []}, "'models' must be a non-empty list"),
    ],
)
def test_bad_matrix_is_refused_by_name(tmp_path, change, words):
    with pytest.raises(LlmcoreError) as err:
        expand(dict(MATRIX, output=str(tmp_path), **change))
    assert words in err.value.one_line() and err.value.stage == "matrix"


def test_content_key_follows_inputs_not_the_output_path(tmp_path):
    checkpoint = tmp_path / "weights.gguf"
    checkpoint.write_bytes(b"one")
    versions = installed_versions()
    base = ExportOptions(model="llama", checkpoint=str(checkpoint), output=str(tmp_path / "a.pte"))
    key = content_key(base, versions, {})
    moved = ExportOptions(model="llama", checkpoint=str(checkpoint), output=str(tmp_path / "b/c.pte"))
    assert content_key(moved, versions, {}) == key
    other = ExportOptions(model="llama", checkpoint=str(checkpoint), output=str(tmp_path / "a.pte"), max_seq_len=32)
    assert content_key(other, versions, {}) != key
    checkpoint.write_bytes(b"two")  # same name, new weights
    assert content_key(base, versions, {}) != key
    assert content_key(base, versions | {"llmcore": "9"}, {}) != content_key(base, versions, {})


def test_dry_run_prints_the_cells_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    path = write_matrix(tmp_path, dict(MATRIX, output=str(out)))
    proc = run_cli("matrix", str(path), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"8 cells under {out}")
    for line in proc.stdout.splitlines()[3:]:
        cell = line.split()[0]
        assert ("fails: [quantize/xnnpack]" in line) == (cell in UNSUPPORTED), line
    assert not out.exists()


# ---- runs on local Ray ---------------------------------------------------------------------


@pytest.mark.slow
def test_interrupted_matrix_resumes_and_every_program_runs(tmp_path):
    out = tmp_path / "out"
    path = write_matrix(tmp_path, dict(MATRIX, output=str(out)))
    command = [*LLMCORE, "matrix", str(path), "--workers", "2"]
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(list(out.rglob("*.report.json"))) < 2 and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.2)
    driver.send_signal(signal.SIGINT)
    stdout, stderr = driver.communicate(timeout=120)
    assert driver.returncode == -signal.SIGINT, stderr  # killed by SIGINT: 130 in a shell
    assert "the same command resumes" in stderr
    first = {c["cell"]: c["status"] for c in read_json(out / "matrix.json")["cells"]}
    done_first = {cell for cell, status in first.items() if status == "ok"}
    assert len(done_first) >= 2 and "interrupted" in first.values()
    assert leftovers(out) == []

    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr  # the two unsupported cells
    cells = {c["cell"]: c for c in read_json(out / "matrix.json")["cells"]}
    assert {n for n, c in cells.items() if c["status"] == "skipped"} == done_first
    assert {n for n, c in cells.items() if c["status"] == "failed"} == UNSUPPORTED
    for name in UNSUPPORTED:
        assert "is meant for xnnpack, not for the portable runtime" in cells[name]["error"]
    good = [c for n, c in cells.items() if n not in UNSUPPORTED]
    assert len(good) == 6 and all(c["status"] in ("ok", "skipped") for c in good)
    assert leftovers(out) == []
    for cell in good:
        report_path = Path(cell["output"]).with_suffix(".report.json")
        report = read_json(report_path)
        assert report["matrix"]["key"] == cell["key"] and report["outputs"]["pte"] == cell["output"]
        assert cell["parity_top1"] == report["parity"]["top1_agreement"]
        check_program_runs(report_path)

    # a third run has nothing left to export: it does not even start Ray
    again = run_cli("matrix", str(path), timeout=120)
    statuses = {c["cell"]: c["status"] for c in read_json(out / "matrix.json")["cells"]}
    assert {statuses[n] for n in statuses if n not in UNSUPPORTED} == {"skipped"}, again.stderr


@pytest.mark.slow
def test_killed_worker_is_retried_and_a_broken_cell_fails_alone(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF but not really")
    out = tmp_path / "out"
    data = {"output": str(out), "common": {"max-seq-len": 64},
            "models": [{"model": "nanogpt", "config": "tiny"}, {"name": "broken", "model": "llama", "checkpoint": str(broken)}],
            "backends": ["xnnpack"], "recipes": ["none"]}
    path = write_matrix(tmp_path, data)
    good = "nanogpt-tiny/xnnpack/none"
    driver = subprocess.Popen([*LLMCORE, "matrix", str(path), "--workers", "2", "--retries", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    deadline = time.monotonic() + 300
    while killed is None and time.monotonic() < deadline and driver.poll() is None:
        # killed inside the export: once its worker has made the cell's scratch folder (a fixed
        # wait after the title appeared could land after a fast machine's export had finished)
        exporting = [pid for pid in ray_workers(good) if scratch_folders(pid)]
        if exporting:
            os.kill(exporting[0], signal.SIGKILL)
            killed = exporting[0]
        time.sleep(0.05)
    stdout, stderr = driver.communicate(timeout=300)
    assert killed is not None, stderr
    cells = {c["cell"]: c for c in read_json(out / "matrix.json")["cells"]}
    assert driver.returncode == 1, stderr
    assert cells[good]["status"] == "ok" and cells[good]["attempts"] == 2
    assert cells[good]["pid"] != killed
    assert cells["broken/xnnpack/none"]["status"] == "failed"
    assert "[load" in cells["broken/xnnpack/none"]["error"]
    assert leftovers(out) == []
    assert not scratch_folders(killed)  # its scratch folder was cleared
    check_program_runs(Path(cells[good]["output"]).with_suffix(".report.json"))
