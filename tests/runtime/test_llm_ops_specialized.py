"""libllmcore_llm_ops.so: the C++ runner's attention kernel in Python processes, registered
for float32, float16 and bfloat16 llama::custom_sdpa under ExecuTorch kernel keys beside
ExecuTorch's own kernel (the core's specialized runtime library ``llmcore_llm_ops``,
:mod:`llmcore.builtins.runtime_attention`).

Each run is a fresh interpreter: kernel registrations are process-wide and cannot be undone.
The authority is ExecuTorch's own kernel (``LLMCORE_SPECIALIZED_KERNELS=0``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_runner import binaries  # noqa: F401


# Prefill of a prompt, then decode steps: logits of each call, and how many attention calls
# reached libllmcore_llm_ops.so's kernel (None: the library is not loaded in this process).
_RUN = r"""
import ctypes, json, sys
from llmcore.runtime import libraries
first = sys.argv[2]
if first == "llm_ops":  # the specialized library before ExecuTorch's custom ops
    from executorch.extension.pybindings import portable_lib
    libraries.load_shared_library(sys.argv[3])
    import executorch.extension.llm.custom_ops.custom_ops  # registers ExecuTorch's fallback kernels
from llmcore.runtime import Program
program = Program.load(sys.argv[1])
rows = [program.logits([5, 17, 3, 9, 40, 2], 0).tolist()]
for pos, token in enumerate([7, 11, 13], start=6):
    rows.append(program.logits([token], pos).tolist())
handle = next((h for path, h in libraries._handles.items() if path.endswith("libllmcore_llm_ops.so")), None)
calls = handle.llmcore_llm_ops_sdpa_calls() if handle is not None else None
print(json.dumps({"logits": rows, "calls": calls}))
"""


@pytest.fixture(scope="module")
def llm_ops_library(binaries):  # noqa: F811
    """libllmcore_llm_ops.so, built with the runner."""
    from llmcore.runtime import libraries

    return libraries.llm_ops_library()


@pytest.fixture(scope="module")
def kv_export(llm_ops_library, tmp_path_factory):
    """The tiny random Llama with its KV cache (llama::update_cache, llama::custom_sdpa), for XNNPACK."""
    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    out = tmp_path_factory.mktemp("kv") / "tiny.pte"
    return export(ExportOptions(model="llama", config="tiny", plugins=["xnnpack"], output=str(out), quiet=True),
                  load_registry())


def _run(pte, *, specialized: bool, first: str = "program", library: str = "") -> dict:
    env = {**os.environ, "LLMCORE_SPECIALIZED_KERNELS": "1" if specialized else "0"}
    done = subprocess.run([sys.executable, "-c", _RUN, str(pte), first, library], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _max_difference(a: list, b: list) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


def test_python_runs_the_runners_attention_kernel_with_executorchs_results(kv_export, llm_ops_library):
    from llmcore.runtime import libraries

    assert "llama::custom_sdpa.out" in libraries.program_operators(kv_export.pte.read_bytes())
    theirs = _run(kv_export.pte, specialized=False)
    ours = _run(kv_export.pte, specialized=True)
    assert theirs["calls"] is None  # not loaded at all when turned off
    layers = 2  # the tiny config: one attention call per layer and forward call
    assert ours["calls"] == 4 * layers, ours["calls"]
    assert _max_difference(ours["logits"], theirs["logits"]) < 1e-4
    # either load order: the keyed registration coexists with ExecuTorch's fallback one
    before = _run(kv_export.pte, specialized=True, first="llm_ops",
                  library=str(llm_ops_library))
    assert before["calls"] == 4 * layers
    assert _max_difference(before["logits"], theirs["logits"]) < 1e-4


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_16_bit_cache_runs_the_runners_attention_kernel_too(llm_ops_library, tmp_path, dtype):
    """A KV cache of 16-bit floats (--kv-cache-dtype) calls llama::custom_sdpa in its type:
    that call reaches this library's kernel too (ExecuTorch's own took 125 ms for a SmolLM2
    prefill call of an fp16 cache), with ExecuTorch's results."""
    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    out = tmp_path / f"{dtype}.pte"
    export(ExportOptions(model="llama", config="tiny", plugins=["xnnpack"], kv_cache_dtype=dtype, output=str(out),
                         quiet=True), load_registry())
    theirs, ours = _run(out, specialized=False), _run(out, specialized=True)
    assert ours["calls"] == 4 * 2, ours["calls"]  # each forward call, each of the two layers
    assert _max_difference(ours["logits"], theirs["logits"]) < 1e-3


def test_no_program_needs_the_specialized_library(kv_export):
    """The core provides it (the runtime's library, not a plugin's); export does not name it,
    and inspect does not list it as a requirement."""
    from llmcore.runtime import libraries
    from llmcore.plugins import load_registry

    registry = load_registry()
    names = [p.record.name for p in libraries.libraries_for_operators(["llama::custom_sdpa.out"], registry)]
    providers = libraries.libraries_for_operators(["llama::custom_sdpa.out", "llama::custom_quantized_sdpa.out"],
                                                  registry, specialized=True)
    assert "llmcore_llm_ops" not in names and [p.record.name for p in providers] == ["llmcore_llm_ops"]
    assert [p.plugin.name for p in providers] == ["runtime-attention"]  # the core's, no plugin's
    assert all(lib["name"] != "llmcore_llm_ops" for lib in kv_export.report["runtime_libraries"])
    data = kv_export.pte.read_bytes()
    assert "llmcore_llm_ops" not in [row["name"] for row in libraries.runtime_library_requirements(data, registry)]
    assert "llmcore_llm_ops" not in libraries.declared_libraries(data)
