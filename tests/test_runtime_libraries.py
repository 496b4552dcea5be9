"""Runtime libraries (the ``llmcore_runtime_libraries`` hook): plugins declare them, a
program's operators select them, and loading a program loads them first.

Uses a throwaway custom op that has no ExecuTorch kernel (``llmcore_test::twice``), so
nothing here needs a native library; plugins/kernels/tests covers a real one.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from llmcore import hookimpl
from llmcore.runtime import libraries
from llmcore.errors import LlmcoreError
from llmcore.plugins import load_registry
from llmcore.records import RuntimeLibrary

_lib = torch.library.Library("llmcore_test", "DEF")
_lib.define("twice(Tensor x) -> Tensor")
_lib.define("twice.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)")
_lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")


def _twice_out(x, *, out):
    out.resize_(x.shape)
    return out.copy_(x * 2)


_lib.impl("twice.out", _twice_out, "CompositeExplicitAutograd")


class KernelsPlugin:
    def __init__(self, module: str | None = None):
        self.module = module

    @hookimpl
    def llmcore_runtime_libraries(self):
        return [RuntimeLibrary(name="fake_kernels", description="fake", ops=("llmcore_test::twice.out",),
                               python_module=self.module)]


class WrongRecordPlugin:
    @hookimpl
    def llmcore_runtime_libraries(self):
        return [{"name": "not-a-record"}]


@pytest.fixture(scope="module")
def program_with_custom_op() -> bytes:
    from executorch.exir import to_edge

    class Twice(torch.nn.Module):
        def forward(self, x):
            return torch.ops.llmcore_test.twice(x) + 1

    ep = torch.export.export(Twice(), (torch.ones(3),))
    edge = to_edge(ep, constant_methods={libraries.RUNTIME_LIBRARIES_METHOD: ["fake_kernels"]})
    return bytes(edge.to_executorch().buffer)


def test_the_hook_is_a_kind_of_extension():
    registry = load_registry(extra_plugins=[("fake", KernelsPlugin()), ("wrong", WrongRecordPlugin())])
    assert "fake_kernels" in registry.names("runtime_libraries")
    fake = next(p for p in registry.plugins if p.name == "fake")
    assert fake.provides["runtime_libraries"] == ["fake_kernels"]
    failure = next(f for f in registry.failures if f.name == "wrong")
    assert "expected llmcore.records.RuntimeLibrary" in failure.error


def test_libraries_are_matched_by_operator_with_or_without_overload():
    registry = load_registry(extra_plugins=[("fake", KernelsPlugin())])
    for ops in (["llmcore_test::twice"], ["llmcore_test::twice.out"], ["aten::add.out", "llmcore_test::twice.out"]):
        assert [p.record.name for p in libraries.libraries_for_operators(ops, registry)] == ["fake_kernels"]
    assert libraries.libraries_for_operators(["aten::add.out", "llmcore_test::thrice.out"], registry) == []


def test_export_graph_operators_are_found():
    class Twice(torch.nn.Module):
        def forward(self, x):
            return torch.ops.llmcore_test.twice(x)

    ep = torch.export.export(Twice(), (torch.ones(3),))
    assert "llmcore_test::twice" in libraries.graph_operators(ep)


def test_a_program_names_its_operators_and_libraries(program_with_custom_op):
    data = program_with_custom_op
    assert "llmcore_test::twice.out" in libraries.program_operators(data)
    assert libraries.declared_libraries(data) == ["fake_kernels"]
    assert libraries.missing_operators(data) == ["llmcore_test::twice.out"]


def test_loading_a_program_loads_the_plugin_library_first(program_with_custom_op, tmp_path, monkeypatch):
    marker = tmp_path / "fake_kernels_mod.py"
    marker.write_text(textwrap.dedent("""
        LOADED = True
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = load_registry(extra_plugins=[("fake", KernelsPlugin("fake_kernels_mod"))])
    loaded = libraries.load_program_libraries(program_with_custom_op, registry)
    assert loaded == ["fake_kernels_mod"] and sys.modules["fake_kernels_mod"].LOADED
    # (the fake module registers no kernel, so the runtime still lacks the op)
    assert libraries.missing_operators(program_with_custom_op) == ["llmcore_test::twice.out"]


class PreparingPlugin:
    def __init__(self, prepare):
        self.prepare = prepare

    @hookimpl
    def llmcore_runtime_libraries(self):
        return [RuntimeLibrary(name="fake_settings", description="fake", ops=(), declared=False,
                               prepare=self.prepare)]


def test_a_library_is_prepared_with_each_programs_delegates(program_with_custom_op):
    """``prepare`` gets the backend ids of the program about to run: none here, XNNPACK's for
    a delegated program; a failure in it names the plugin."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    seen = []
    registry = load_registry(extra_plugins=[("fake", PreparingPlugin(seen.append))])
    libraries.prepare_libraries(program_with_custom_op, registry)
    linear = torch.nn.Linear(8, 8)
    ep = torch.export.export(linear, (torch.ones(1, 8),))
    delegated = bytes(to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)
    libraries.prepare_libraries(delegated, registry)
    assert seen == [(), ("XnnpackBackend",)]

    def broken(delegates):
        raise RuntimeError("no such setting")

    with pytest.raises(LlmcoreError) as info:
        libraries.prepare_libraries(delegated, load_registry(extra_plugins=[("fake", PreparingPlugin(broken))]))
    assert info.value.stage == "run" and info.value.plugin == "fake"


def test_a_library_that_cannot_load_names_its_plugin(program_with_custom_op, tmp_path, monkeypatch):
    module = tmp_path / "broken_kernels_mod.py"
    module.write_text(
        "from llmcore.errors import LlmcoreError\n"
        "raise LlmcoreError('libfake.so is not built.', fix='run make runner.')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = load_registry(extra_plugins=[("fake", KernelsPlugin("broken_kernels_mod"))])
    with pytest.raises(LlmcoreError) as info:
        libraries.load_program_libraries(program_with_custom_op, registry)
    assert info.value.stage == "run" and info.value.plugin == "fake" and "make runner" in info.value.fix


def test_a_missing_kernel_error_says_which_library_is_needed(program_with_custom_op, monkeypatch):
    from llmcore.runtime import Program

    monkeypatch.setenv("LLMCORE_LOAD_PLUGINS", "")  # no plugin provides the library
    with pytest.raises(LlmcoreError) as info:  # at load: ``forward`` loads with the program
        Program.load(program_with_custom_op)
    assert "llmcore_test::twice.out" in str(info.value) or "operator" in str(info.value)
    assert "fake_kernels" in info.value.fix and libraries.RUNTIME_LIBRARIES_ENV in info.value.fix
    rows = libraries.runtime_library_requirements(program_with_custom_op, load_registry())
    assert rows == [{"name": "fake_kernels", "declared": True, "plugin": None, "ops": [], "python_module": None,
                     "shared_library": None, "error": "no installed plugin provides it"}]


def test_a_load_finds_the_plugins_of_its_own_allowlist(monkeypatch):
    """Program loads find plugins through a registry made once per process; one made while
    ``LLMCORE_LOAD_PLUGINS`` named none must not stand for a later load without the
    setting (it did: the kernels of every later program went unprepared)."""
    from llmcore.plugins import ALLOWLIST_ENV

    monkeypatch.delenv(ALLOWLIST_ENV, raising=False)
    everything = {p.name for p in libraries._installed_registry().plugins}
    assert everything == {p.name for p in load_registry().plugins}
    monkeypatch.setenv(ALLOWLIST_ENV, "")  # only the built-in records
    assert {p.name for p in libraries._installed_registry().plugins} == {p.name for p in load_registry().plugins}
    monkeypatch.delenv(ALLOWLIST_ENV)
    assert {p.name for p in libraries._installed_registry().plugins} == everything


def test_the_environment_variable_loads_native_libraries(program_with_custom_op, tmp_path, monkeypatch):
    monkeypatch.setenv(libraries.RUNTIME_LIBRARIES_ENV, str(tmp_path / "libnothere.so"))
    with pytest.raises(LlmcoreError, match="libnothere.so"):
        libraries.load_program_libraries(program_with_custom_op, load_registry(extra_plugins=[]))
    monkeypatch.setenv(libraries.RUNTIME_LIBRARIES_ENV, str(tmp_path))  # a folder without libfake_kernels.so
    monkeypatch.setenv("LLMCORE_LOAD_PLUGINS", "")
    assert libraries.load_program_libraries(program_with_custom_op) == []


def test_executorch_kernel_libraries_list_what_their_modules_register():
    """The built-in records of ExecuTorch's LLM custom ops and quantized kernels name exactly
    the operators their modules add to this runtime (checked in a fresh process, where
    neither is imported yet), and are not named in programs (llmcore_runner links both)."""
    import subprocess
    import sys

    from llmcore.builtins import executorch_kernels as ek

    code = (
        "import importlib, json, sys\n"
        "from executorch.extension.pybindings import portable_lib as p\n"
        "out = {}\n"
        "for m in sys.argv[1:]:\n"
        "    before = set(p._get_operator_names()); importlib.import_module(m)\n"
        "    out[m] = sorted(set(p._get_operator_names()) - before)\n"
        "print(json.dumps(out))\n"
    )
    run = subprocess.run([sys.executable, "-c", code, ek.LLM_CUSTOM_OPS_MODULE, ek.QUANTIZED_KERNELS_MODULE],
                         capture_output=True, text=True, check=True)
    added = json.loads(run.stdout.strip().splitlines()[-1])
    records = {r.python_module: r for r in ek.llmcore_runtime_libraries()}
    for module, ops in added.items():
        assert sorted(records[module].ops) == ops, module
        assert not records[module].declared


def test_a_quantized_kv_cache_program_loads_executorch_kernels_by_its_operators(tmp_path):
    """A program calling llama:: and quantized_decomposed:: ops runs in a fresh process with
    nothing imported by hand: Program.load finds both libraries from its operator table."""
    import subprocess
    import sys

    out = tmp_path / "q.pte"
    run = subprocess.run([sys.executable, "-m", "llmcore", "export", "--model", "llama", "--config", "tiny",
                          "--plugins", "xnnpack", "--quantize", "8da4w", "--quiet", "-o", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert "executorch_llm_custom_ops" in {lib["name"] for lib in report["runtime_libraries"]}
    # Program.load loads the custom ops' native library, not their module (which imports
    # ExecuTorch's compiler); the module imported afterwards, as an export in the same process
    # would, registers nothing twice. The logits equal those of a process that imported the
    # module first.
    code = (
        "import importlib, json, sys, torch\n"
        "from llmcore.builtins.executorch_kernels import LLM_CUSTOM_OPS_MODULE\n"
        "from llmcore.runtime import Program\n"
        "if sys.argv[2] == 'module-first':\n"
        "    importlib.import_module(LLM_CUSTOM_OPS_MODULE)\n"
        "p = Program.load(sys.argv[1])\n"
        "assert p.runtime_libraries == [], p.runtime_libraries\n"
        "first = p.logits([1, 2, 3], 0)\n"
        "compiler = sorted(m for m in ('executorch.exir', 'torch._inductor') if m in sys.modules)\n"
        "importlib.import_module(LLM_CUSTOM_OPS_MODULE)\n"
        "again = p.logits([1, 2, 3], 0)\n"
        "print(json.dumps({'logits': first.tolist(), 'compiler': compiler, 'same': bool(torch.equal(first, again))}))\n"
    )
    outcomes = {}
    for order in ("load-only", "module-first"):
        run = subprocess.run([sys.executable, "-c", code, str(out), order], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        outcomes[order] = json.loads(run.stdout.strip().splitlines()[-1])
        assert outcomes[order]["same"], order
    assert outcomes["load-only"]["compiler"] == []
    assert outcomes["load-only"]["logits"] == outcomes["module-first"]["logits"]


def test_the_custom_ops_library_is_the_one_their_module_loads():
    """``llm_custom_ops_library`` finds the file that importing ExecuTorch's LLM custom ops
    loads (checked in a fresh process), so that loading it first and importing the module
    later is one ``dlopen``."""
    import subprocess

    code = (
        "import importlib, json, torch\n"
        "from llmcore.builtins import executorch_kernels as ek\n"
        "found = str(ek.llm_custom_ops_library().resolve())\n"
        "importlib.import_module(ek.LLM_CUSTOM_OPS_MODULE)\n"
        "from pathlib import Path\n"
        "print(json.dumps({'found': found, 'loaded': sorted(str(Path(p).resolve()) for p in torch.ops.loaded_libraries)}))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["found"] in result["loaded"]
