"""`llmcore inspect` as a user runs it: what a program needs, checked against this runtime,
and `llmcore run` on programs this runtime cannot run."""

from __future__ import annotations

import json

import pytest

from clitools import read_json, run_cli
from programs import vulkan_program

TINY = ["export", "--model", "nanogpt", "--config", "tiny"]


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """A quantized KV-cache export (XNNPACK + llama:: custom ops), a program lowered for
    Vulkan (which this runtime lacks), one calling an operator no runtime has, and broken
    files."""
    folder = tmp_path_factory.mktemp("inspect")
    out = folder / "tiny8.pte"
    result = run_cli(*TINY, "--plugins", "xnnpack", "--quantize", "int8-dynamic", "--quiet", "-o", str(out))
    assert result.returncode == 0, result.stderr
    data = out.read_bytes()
    paths = {"int8": out, "report": folder / "tiny8.report.json"}

    paths["truncated"] = folder / "truncated.pte"
    paths["truncated"].write_bytes(data[: len(data) // 2])
    paths["damaged"] = folder / "damaged.pte"
    paths["damaged"].write_bytes(_damage(data))
    paths["vulkan"] = vulkan_program(folder / "vulkan.pte")
    paths["missing_op"] = _program_with_missing_operator(folder)
    return paths


def _damage(data: bytes) -> bytes:
    """Keep the header, overwrite the program table: the file identifier still says 'ET12'."""
    from executorch.exir._serialize._program import _get_extended_header

    size = _get_extended_header(data).program_size
    return data[:64] + b"\xff" * (size - 64) + data[size:]


def _program_with_missing_operator(folder):
    """A portable program whose first kernel is renamed to one no runtime registers."""
    import torch
    from executorch.exir import to_edge
    from executorch.exir._serialize._program import deserialize_pte_binary, serialize_pte_binary

    class Tiny(torch.nn.Module):
        def forward(self, x):
            return x * 2 + 1

    buffer = to_edge(torch.export.export(Tiny(), (torch.randn(2, 3),))).to_executorch().buffer
    pte = deserialize_pte_binary(buffer)
    plan = pte.program.execution_plan[0]
    mul = next(op for op in plan.operators if op.name == "aten::mul")
    mul.name = "llmcore_test::no_such_kernel"
    path = folder / "missing_op.pte"
    path.write_bytes(bytes(serialize_pte_binary(pte)))
    return path


def _inspect_json(path):
    result = run_cli("inspect", str(path), "--json")
    return result, json.loads(result.stdout) if result.stdout.strip() else None


def _one_line_error(result, expected):
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_inspect_an_exported_program(programs):
    result = run_cli("inspect", str(programs["int8"]))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "forward" in out and "int64[1, <=128], int64[1]" in out  # tokens and input_pos
    assert "XnnpackBackend" in out and "available" in out
    # custom ops are called out, with where their kernels come from
    assert "llama::custom_sdpa.out" in out and "llama::update_cache.out" in out
    assert "custom op" in out and "executorch.extension.llm.custom_ops" in out
    assert "OK: this runtime has every backend and operator" in out


def test_inspect_json_metadata_matches_the_export_report(programs):
    result, data = _inspect_json(programs["int8"])
    assert result.returncode == 0, result.stderr
    report = read_json(programs["report"])
    assert data["metadata"] == report["metadata_methods"]
    assert data["metadata_missing"] == []
    assert data["ok"] is True and data["missing"] == {"backends": [], "operators": []}
    assert [b["id"] for b in data["backends"]] == ["XnnpackBackend"]
    assert data["backends"][0]["delegates"] == report["delegation"]["delegated_subgraphs"]
    kinds = {o["name"]: o["kind"] for o in data["operators"]}
    assert kinds["llama::custom_sdpa.out"] == "custom"
    assert kinds["aten::embedding.out"] == "aten"
    assert all(o["available"] for o in data["operators"])


def test_inspect_agrees_with_the_runtimes_method_meta(programs):
    """The shapes and dtypes inspect reads from the flatbuffer are the ones the runtime sees."""
    from executorch.extension.pybindings import portable_lib

    from llmcore.runtime.libraries import load_program_libraries

    _, data = _inspect_json(programs["int8"])
    pte_bytes = programs["int8"].read_bytes()
    load_program_libraries(pte_bytes)
    # The program reads the buffer it was loaded from: a temporary freed after the call
    # left method_meta reading freed memory (a segfault, depending on the heap).
    program = portable_lib._load_program_from_buffer(pte_bytes)
    forward = next(m for m in data["methods"] if m["name"] == "forward")
    meta = program.method_meta("forward")
    assert meta.num_inputs() == len(forward["inputs"]) and meta.num_outputs() == len(forward["outputs"])
    for i, spec in enumerate(forward["inputs"]):
        assert list(meta.input_tensor_meta(i).sizes()) == spec["shape"]
    assert list(meta.output_tensor_meta(0).sizes()) == forward["outputs"][0]["shape"]
    del program, pte_bytes  # the program first
    assert forward["inputs"][0]["dtype"] == "int64" and forward["outputs"][0]["dtype"] == "float32"


def test_inspect_flags_a_backend_this_runtime_lacks(programs):
    result = run_cli("inspect", str(programs["vulkan"]))
    assert result.returncode == 3, result.stderr
    assert "VulkanBackend" in result.stdout and "MISSING" in result.stdout
    assert "Vulkan" in result.stdout.split("MISSING:", 1)[1]  # names where it runs
    result, data = _inspect_json(programs["vulkan"])
    assert result.returncode == 3
    assert data["missing"] == {"backends": ["VulkanBackend"], "operators": []}
    assert data["ok"] is False
    assert data["metadata"] == {}  # not an llmcore LLM program, and inspect says so without failing


def test_run_names_the_missing_backend_and_where_it_runs(programs):
    result = run_cli("run", str(programs["vulkan"]), "--prompt", "hi", "--max-new-tokens", "2")
    _one_line_error(result, "needs backend VulkanBackend")
    assert "GPUs through Vulkan" in result.stderr
    assert "llmcore inspect" in result.stderr


def test_inspect_flags_an_operator_this_runtime_lacks(programs):
    result, data = _inspect_json(programs["missing_op"])
    assert result.returncode == 3
    assert data["missing"] == {"backends": [], "operators": ["llmcore_test::no_such_kernel.out"]}
    assert "MISSING: operator llmcore_test::no_such_kernel.out" in run_cli("inspect", str(programs["missing_op"])).stdout
    run = run_cli("run", str(programs["missing_op"]), "--prompt", "hi", "--max-new-tokens", "2")
    _one_line_error(run, "uses an operator this runtime lacks")
    assert "llmcore_test::no_such_kernel.out" in run.stderr


@pytest.mark.parametrize(
    "name, expected",
    [
        ("truncated", "is truncated: its header says"),
        ("damaged", "is damaged"),
    ],
)
def test_broken_programs_get_one_line(programs, name, expected):
    _one_line_error(run_cli("inspect", str(programs[name])), expected)
    _one_line_error(run_cli("inspect", str(programs[name]), "--json"), expected)


def test_a_file_that_is_not_a_program(programs, tmp_path):
    not_pte = programs["int8"].parent / "tokenizer.json"
    _one_line_error(run_cli("inspect", str(not_pte)), "is not an ExecuTorch program")
    empty = tmp_path / "empty.pte"
    empty.write_bytes(b"")
    _one_line_error(run_cli("inspect", str(empty)), "is not an ExecuTorch program")
    _one_line_error(run_cli("inspect", str(tmp_path / "nope.pte")), "does not exist")


def test_help_documents_the_exit_codes():
    result = run_cli("inspect", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "0 when this runtime has everything" in text and "3 when a backend or an operator is missing" in text
