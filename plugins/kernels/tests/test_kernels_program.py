"""A program exported with --transforms fused-rmsnorm: what it records, and that it runs
and matches the original eager model in the Python runtime (in this process and in a fresh
`llmcore run`) and in llmcore_runner; and the errors when the library is missing."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from llmcore.runtime import libraries
from llmcore.plugins import load_registry
from llmcore.recipe import ExportOptions
from llmcore_kernels import OPS

PROMPT = "Hello there, world"


def original_model():
    """The same random tiny Llama the export started from, without any transform."""
    from llmcore.pipeline.load import load_model
    from llmcore.pipeline.plan import resolve_plan

    loaded = load_model(resolve_plan(ExportOptions(model="llama", config="tiny", output="unused.pte"), load_registry()))
    return loaded.module.eval()


def test_the_program_names_its_runtime_library(fused_export):
    data = fused_export.pte.read_bytes()
    ops = libraries.program_operators(data)
    assert "llmcore::rms_norm.out" in ops
    assert "aten::mean.out" not in ops  # the norm's mean was the one op XNNPACK left out
    assert libraries.declared_libraries(data) == ["llmcore_kernels"]
    # the report lists every library the graph calls: ExecuTorch's LLM ops (the KV cache) too,
    # which the program does not name (every runtime has them)
    entries = fused_export.report["runtime_libraries"]
    assert sorted(e["name"] for e in entries) == ["executorch_llm_custom_ops", "llmcore_kernels"]
    (entry,) = [e for e in entries if e["name"] == "llmcore_kernels"]
    # the library's operators (the program calls one of them)
    assert entry["ops"] == list(OPS)
    assert entry["python_module"] == "llmcore_kernels.ops"
    assert entry["shared_library"].endswith("libllmcore_kernels.so")
    assert "fused-rmsnorm" in fused_export.report["transforms"]
    on_disk = json.loads(fused_export.report_path.read_text())
    assert on_disk["runtime_libraries"] == entries
    rows = {row["name"]: row for row in libraries.runtime_library_requirements(data)}
    row = rows["llmcore_kernels"]
    assert row["declared"] and row["plugin"].startswith("llmcore-kernels") and row["error"] is None
    assert not rows["executorch_llm_custom_ops"]["declared"] and rows["executorch_llm_custom_ops"]["error"] is None


def test_the_program_matches_the_original_eager_model(fused_export):
    from llmcore.runtime import Program

    program = Program.load(fused_export.pte)
    assert program.runtime_libraries == ["llmcore_kernels"]
    model = original_model()
    ids = list(range(40, 60))
    with torch.no_grad():  # no cache: the whole prefix each time; logits of its last position
        prefill_want = model(torch.tensor([ids[:-1]])).reshape(-1, program_vocab(program))[-1]
        step_want = model(torch.tensor([ids])).reshape(-1, program_vocab(program))[-1]
    prefill_got = program.logits(ids[:-1], 0)
    step_got = program.logits(ids[-1:], len(ids) - 1)
    # Measured: max |difference| 1.2e-7 on logits of magnitude ~1.0, as without the kernel.
    torch.testing.assert_close(prefill_got, prefill_want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step_got, step_want, atol=1e-4, rtol=1e-4)


def program_vocab(program) -> int:
    return int(program.metadata["get_vocab_size"])


def _runner_ids(runner, pte, *extra, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(runner), str(pte), "--prompt", PROMPT, "--max-new-tokens", "16", "--temperature", "0", "--print-ids",
         *extra],
        capture_output=True, text=True, timeout=300, env=env,
    )


def _ids(stdout: str) -> list[int]:
    line = next(l for l in stdout.splitlines() if l.startswith("ids:"))
    return [int(i) for i in line.split()[1:]]


def test_llmcore_run_and_llmcore_runner_load_the_library_and_agree(fused_export, runner, llmcore_cli):
    # A fresh process: `llmcore run` finds the plugin that provides llmcore::rms_norm.out.
    result = llmcore_cli("run", str(fused_export.pte), "--prompt", PROMPT, "--max-new-tokens", "16", "--json")
    assert result.returncode == 0, result.stderr
    python_ids = json.loads(result.stdout)["generated_ids"]
    # The C++ runner finds lib<name>.so of the declared library next to itself.
    out = _runner_ids(runner, fused_export.pte)
    assert out.returncode == 0, out.stderr
    assert _ids(out.stdout) == python_ids


def test_llmcore_runner_elsewhere_needs_the_library(fused_export, runner, kernel_library, tmp_path):
    import os

    from llmcore_kernels import library

    lone = tmp_path / "llmcore_runner"  # a runner with no library beside it
    shutil.copy2(runner, lone)
    env = {k: v for k, v in os.environ.items() if k != libraries.RUNTIME_LIBRARIES_ENV}
    missing = _runner_ids(lone, fused_export.pte, env=env)
    assert missing.returncode == 1
    assert "llmcore_kernels" in missing.stderr and "--load-library" in missing.stderr
    assert "OperatorMissing" in missing.stderr

    expected = _ids(_runner_ids(runner, fused_export.pte).stdout)
    flag = _runner_ids(lone, fused_export.pte, "--load-library", str(kernel_library / library.RUNTIME_LIBRARY), env=env)
    assert flag.returncode == 0, flag.stderr
    assert _ids(flag.stdout) == expected
    by_env = _runner_ids(lone, fused_export.pte, env={**env, libraries.RUNTIME_LIBRARIES_ENV: str(kernel_library)})
    assert by_env.returncode == 0, by_env.stderr
    assert _ids(by_env.stdout) == expected


def test_an_unbuilt_library_is_a_clear_error(fused_export, llmcore_cli, tmp_path):
    from llmcore_kernels import library

    env = {library.LIB_DIR_ENV: str(tmp_path)}  # an empty folder: "not built"
    run = llmcore_cli("run", str(fused_export.pte), "--prompt", "hi", "--max-new-tokens", "2", env=env)
    assert run.returncode != 0
    assert "[run/kernels]" in run.stderr and "make runner" in run.stderr and "Traceback" not in run.stderr

    out = tmp_path / "x.pte"
    export = llmcore_cli("export", "--model", "llama", "--config", "tiny", "--transforms", "fused-rmsnorm",
                         "-o", str(out), env=env)
    assert export.returncode != 0
    assert "[transform/kernels]" in export.stderr and "make runner" in export.stderr
    assert not out.exists()


def test_inspect_names_the_kernel_library(fused_export):
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "llmcore", "inspect", str(fused_export.pte), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    names = [lib["name"] for lib in data["runtime_libraries"]]
    assert "llmcore_kernels" in names
    assert data["ok"] is True
