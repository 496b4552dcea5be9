"""Runtime libraries: the custom-operator kernels a program needs besides ExecuTorch's own.

A plugin declares them with the ``llmcore_runtime_libraries`` hook
(:class:`llmcore.records.RuntimeLibrary`: the operators it registers, a Python module that
registers them with PyTorch and the ExecuTorch runtime, its native library). Then:

* **export** finds the libraries whose operators the exported graph calls
  (:func:`graph_operators`, :func:`libraries_for_operators`), names them in the program
  (the constant method ``get_runtime_libraries``, a list of names) and in the report;
* **running** (:meth:`llmcore.runtime.Program.load`, hence ``llmcore run``, ``profile``,
  ``eval``) calls :func:`load_program_libraries` before the program's methods load: it
  loads what ``LLMCORE_RUNTIME_LIBRARIES`` names, then, for operators this runtime still
  lacks, the runtime libraries of installed plugins that register them;
* **inspect** can list them with :func:`runtime_library_requirements`.

A library marked ``specialized`` provides nothing a program needs, only faster kernels for
some tensors of ops another library provides (:func:`load_specialized_kernels`): export
leaves it out, and running loads it when it is built, unless ``LLMCORE_SPECIALIZED_KERNELS=0``.

``LLMCORE_RUNTIME_LIBRARIES`` is a ``:``-separated list of native libraries to load, or of
folders holding ``lib<name>.so`` for the names a program declares; ``llmcore_runner``
reads it too (and looks next to itself).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

from llmcore.runtime import pte
from llmcore.errors import LlmcoreError, stage_errors

BUILD_DIR_ENV = "LLMCORE_BUILD_DIR"
LLM_OPS_LIBRARY = "libllmcore_llm_ops.so"
_CHECKOUT = Path(__file__).resolve().parents[2]  # an editable install's checkout
RUNTIME_LIBRARIES_METHOD = "get_runtime_libraries"
RUNTIME_LIBRARIES_ENV = "LLMCORE_RUNTIME_LIBRARIES"
SPECIALIZED_KERNELS_ENV = "LLMCORE_SPECIALIZED_KERNELS"

_handles: dict[str, Any] = {}  # native libraries loaded here: path -> handle (kept alive)


# ---- the runtime's own library ------------------------------------------------------------


def build_dir() -> Path:
    """Where ``make runner`` put the runtime's libraries: ``$LLMCORE_BUILD_DIR``, else
    ``build/`` of the checkout llmcore is installed from."""
    value = os.environ.get(BUILD_DIR_ENV)
    return Path(value) if value else _CHECKOUT / "build"


def llm_ops_built() -> bool:
    """Whether ``libllmcore_llm_ops.so`` (the runtime's attention kernels for Python
    processes, runtime/kernels/llm_ops.cpp) is built."""
    return (build_dir() / LLM_OPS_LIBRARY).is_file()


def llm_ops_library() -> Path:
    """``libllmcore_llm_ops.so``, or a one-line error that says how to build it. Every
    loader of it goes through here: two copies in one process would each register its ops."""
    path = build_dir() / LLM_OPS_LIBRARY
    if not path.is_file():
        raise LlmcoreError(
            f"the runtime's attention library {LLM_OPS_LIBRARY} is not built (looked in {path.parent}).",
            fix=f"run `make runner` in {_CHECKOUT}, or set {BUILD_DIR_ENV} to the folder that holds it.",
        )
    return path


# ---- what a program calls and declares ---------------------------------------------------


def program_operators(data: Any) -> list[str]:
    """Operators a serialized program calls outside its delegates, named as the runtime
    registers them (``aten::add.out``, ``llmcore::rms_norm.out``)."""
    return pte.operators(data)


def declared_libraries(data: Any) -> list[str]:
    """The names the program's ``get_runtime_libraries`` method returns (none if it has none)."""
    return [str(name) for name in pte.constant_methods(data).get(RUNTIME_LIBRARIES_METHOD, [])]


def _read(data: Any) -> tuple[list[str], list[str]]:
    """(operators, declared library names) of a serialized program."""
    return program_operators(data), declared_libraries(data)


def unregistered(ops: list[str]) -> list[str]:
    """Those of ``ops`` this process's ExecuTorch runtime has no kernel for."""
    have = set(runtime_bindings()._get_operator_names())
    return [op for op in ops if op not in have]


def missing_operators(data: Any) -> list[str]:
    """The program's operators that this process's ExecuTorch runtime has no kernel for."""
    return unregistered(program_operators(data))


def operator_name(target: Any) -> Optional[str]:
    """``namespace::name`` of an ATen or edge-dialect operator (the edge dialect wraps the
    ATen one); None for anything else a node may call."""
    import torch

    if not isinstance(target, torch._ops.OpOverload):
        target = getattr(target, "_op", None)
    return target._schema.name if isinstance(target, torch._ops.OpOverload) else None


def graph_operators(exported: Any) -> set[str]:
    """``namespace::name`` of the operators an ``ExportedProgram`` calls (ATen or edge
    dialect; a lowered program's delegates not looked into), including those wrapped by
    ``auto_functionalized`` (mutating custom ops)."""
    import torch

    names: set[str] = set()
    for node in exported.graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        targets = [node.target]
        if isinstance(node.target, torch._ops.HigherOrderOperator) and node.args:
            targets.append(node.args[0])
        names.update(name for name in map(operator_name, targets) if name is not None)
    return names


def _base(op: str) -> str:
    """``llmcore::rms_norm.out`` -> ``llmcore::rms_norm``."""
    return op.split(".", 1)[0]


def libraries_for_operators(ops: Iterable[str], registry: Any, *, specialized: bool = False) -> list:
    """The installed runtime libraries (``Provided`` records) that provide any of ``ops``
    (given with or without an overload); with ``specialized``, those that only specialize
    them instead (:attr:`llmcore.records.RuntimeLibrary.specialized`)."""
    return libraries_providing(ops, registry.all("runtime_libraries"), specialized=specialized)


def libraries_providing(ops: Iterable[str], installed: Iterable[Any], *, specialized: bool = False) -> list:
    """:func:`libraries_for_operators` among the ``installed`` libraries (an export plan's)."""
    wanted = {_base(op) for op in ops}
    return [p for p in installed
            if p.record.specialized == specialized and {_base(op) for op in p.record.ops} & wanted]


# ---- loading -----------------------------------------------------------------------------


def load_shared_library(path: str | Path) -> None:
    """Load a native kernel library into this process; its kernels register themselves
    with the ExecuTorch runtime it links."""
    key = str(Path(path).resolve())
    if key in _handles:
        return
    try:
        _handles[key] = ctypes.CDLL(key, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError as exc:
        raise LlmcoreError(
            f"runtime library {str(path)!r} could not be loaded: {exc}.",
            stage="run",
            fix=f"check the path (and {RUNTIME_LIBRARIES_ENV}); rebuild the library against this executorch.",
        ) from exc


def load_runtime_library(provided: Any, *, stage: str = "run") -> str:
    """Load one plugin's runtime library here: the native library its Python module would
    load where the record names it and the module is not imported yet, else its Python
    module when it has one (PyTorch and ExecuTorch registration), else its runtime-only
    native library. Returns what was loaded."""
    record, plugin = provided.record, provided.plugin
    fix = "check that the plugin is installed and built (`llmcore plugins`)."
    with stage_errors(stage, plugin.name, f"runtime library {record.name!r} could not be loaded", fix):
        if record.module_library is not None and record.python_module not in sys.modules:
            import torch

            path = record.module_library()
            torch.ops.load_library(str(path))
            return str(path)
        if record.python_module:
            importlib.import_module(record.python_module)
            return record.python_module
        if record.shared_library is not None:
            path = record.shared_library()
            load_shared_library(path)
            return str(path)
    raise LlmcoreError(
        f"runtime library {record.name!r} names neither a python_module nor a shared_library.",
        stage=stage,
        plugin=plugin.name,
        fix="report it to the plugin's authors.",
    )


def _load_from_env(declared: list[str]) -> list[str]:
    loaded = []
    for entry in filter(None, os.environ.get(RUNTIME_LIBRARIES_ENV, "").split(os.pathsep)):
        path = Path(entry)
        if path.is_dir():
            for name in declared:
                candidate = path / f"lib{name}.so"
                if candidate.is_file():
                    load_shared_library(candidate)
                    loaded.append(str(candidate))
        else:
            load_shared_library(path)
            loaded.append(str(path))
    return loaded


def load_program_libraries(data: Any, registry: Optional[Any] = None) -> list[str]:
    """Load what a program needs beyond the runtime's built-in kernels, before its methods
    load: the libraries ``LLMCORE_RUNTIME_LIBRARIES`` names, then, if the runtime still
    lacks some of the program's operators, the runtime libraries of installed plugins that
    register them. Returns what was loaded. Operators that no plugin provides are left for
    the runtime's load error (see :func:`missing_library_hint`)."""
    try:
        ops, declared = _read(data)
    except Exception:  # not a readable program: loading it reports that
        return []
    missing = unregistered(ops)
    loaded = _load_from_env(declared)
    if loaded:
        missing = unregistered(ops)
    if missing:
        loaded += load_libraries_for(missing, registry)
    return loaded + load_specialized_kernels(ops, registry)


def prepare_libraries(data: Any, registry: Optional[Any] = None) -> None:
    """Give every installed runtime library that has a ``prepare`` the program about to
    run (its delegates' backend ids; see :class:`llmcore.records.RuntimeLibrary`)."""
    try:
        delegates = tuple(pte.delegate_ids(data))
    except Exception:  # not a readable program: loading it reports that
        return
    if registry is None:
        registry = _installed_registry()
    for provided in registry.all("runtime_libraries"):
        if provided.record.prepare is not None:
            with stage_errors("run", provided.plugin.name, "preparing its runtime library failed",
                              "reinstall the plugin, or uninstall it (--debug shows the traceback)."):
                provided.record.prepare(delegates)


def load_specialized_kernels(ops: Iterable[str], registry: Optional[Any] = None) -> list[str]:
    """Load the built native libraries of installed plugins that specialize any of ``ops``
    (faster kernels for some dtypes, under ExecuTorch kernel keys); returns their paths.
    One that is not built, or does not load, is passed over: the ops' own kernels serve.
    ``LLMCORE_SPECIALIZED_KERNELS=0`` loads none (to compare, or to run ExecuTorch's own)."""
    ops = list(ops)
    if not ops or os.environ.get(SPECIALIZED_KERNELS_ENV, "1") == "0":
        return []
    if registry is None:
        registry = _installed_registry()
    return _load_those_built(libraries_for_operators(ops, registry, specialized=True))


def _load_those_built(provided_libraries: Iterable[Any]) -> list[str]:
    """Load each library's native file where it is built; the others are passed over (they
    only speed things up). Returns the paths loaded."""
    loaded = []
    for provided in provided_libraries:
        if provided.record.shared_library is None:
            continue
        try:
            path = provided.record.shared_library()
            load_shared_library(path)
        except LlmcoreError:
            continue
        loaded.append(str(path))
    return loaded


# The bindings' extension module: `_C` from ExecuTorch 1.5, `_portable_lib` before (the
# MPS plugin's environment keeps 1.4). The first that is installed is the one.
BINDINGS_MODULES = ("executorch.extension.pybindings._C", "executorch.extension.pybindings._portable_lib")


def runtime_bindings() -> Any:
    """ExecuTorch's runtime bindings: the extension module itself, not ``portable_lib``, the
    module that re-exports it. ``portable_lib`` imports ``executorch.exir`` to define the
    class of the warning it prints, and with it the compiler (torch._dynamo, inductor): a
    slow start for every ``llmcore run`` (docs/performance.md, "Measurements behind the
    code"), for nothing a program's run uses.
    (Its other work, finding OpenVINO's library and Windows DLL folders, is for backends
    llmcore does not run.)"""
    import torch  # noqa: F401  the bindings link libtorch: PyTorch loads it first

    for name in BINDINGS_MODULES:
        if importlib.util.find_spec(name) is not None:
            return importlib.import_module(name)
    raise ModuleNotFoundError(f"no ExecuTorch runtime bindings: none of {', '.join(BINDINGS_MODULES)} is installed",
                              name=BINDINGS_MODULES[0])


def load_preloaded_libraries(registry: Optional[Any] = None) -> list[str]:
    """Load the built ``preload`` libraries of installed plugins, before this process
    imports ExecuTorch's bindings (:attr:`llmcore.records.RuntimeLibrary.preload`); returns
    their paths. After the import nothing is loaded: the bindings' libraries are bound by
    then. One that is not built, or does not load, is passed over."""
    if any(name in sys.modules for name in BINDINGS_MODULES):
        return []
    if registry is None:
        registry = _installed_registry()
    return _load_those_built(p for p in registry.all("runtime_libraries") if p.record.preload)


def _installed_registry() -> Any:
    """The installed plugins, discovered once per process (every program load asks) for each
    setting of ``LLMCORE_LOAD_PLUGINS``, which decides which of them load: a registry made
    while it named none must not stand for the plugins of a later load without it."""
    from llmcore.plugins import ALLOWLIST_ENV

    return _registry_allowing(os.environ.get(ALLOWLIST_ENV))


@functools.lru_cache(maxsize=4)
def _registry_allowing(allowlist: Optional[str]) -> Any:
    """The registry ``load_registry`` makes under this setting (it reads the setting itself:
    ``allowlist`` is the cache's key)."""
    from llmcore.plugins import load_registry

    return load_registry()


def load_libraries_for(ops: Iterable[str], registry: Optional[Any] = None, *, stage: str = "run",
                       skip_failures: bool = False) -> list[str]:
    """Load the installed runtime libraries that register any of ``ops``; returns what was
    loaded. With ``skip_failures`` a library that cannot load is passed over (``inspect``
    then reports its operators as unavailable) instead of raising."""
    ops = list(ops)
    if not ops:
        return []
    if registry is None:
        registry = _installed_registry()
    loaded = []
    for provided in libraries_for_operators(ops, registry):
        try:
            loaded.append(load_runtime_library(provided, stage=stage))
        except LlmcoreError:
            if not skip_failures:
                raise
    return loaded


def missing_library_hint(data: Any) -> str:
    """For a load error about a missing operator: which runtime libraries the program
    declares, and how to provide them ("" when it declares none)."""
    try:
        declared = declared_libraries(data)
    except Exception:
        return ""
    if not declared:
        return ""
    names = ", ".join(declared)
    return (
        f"the program needs runtime libraries {names}: install the plugin that provides them "
        f"(`llmcore plugins` lists runtime libraries) and build it, or point {RUNTIME_LIBRARIES_ENV} "
        f"at lib<name>.so."
    )


def runtime_library_requirements(data: Any, registry: Optional[Any] = None) -> list[dict[str, Any]]:
    """The runtime libraries a program needs, for ``llmcore inspect``: each library it
    declares or whose operators it calls, with the plugin that provides it here (``None``
    when none does), its Python module, and its native library (``None`` with ``error``
    when it is not built)."""
    if registry is None:  # discovered now: inspect reports what is installed at this moment
        from llmcore.plugins import load_registry

        registry = load_registry()
    ops, declared = _read(data)
    by_name = {p.record.name: p for p in registry.all("runtime_libraries")}
    providing = {p.record.name: p for p in libraries_for_operators(ops, registry)}
    rows = []
    for name in [*declared, *(n for n in providing if n not in declared)]:
        provided = by_name.get(name)
        row: dict[str, Any] = {"name": name, "declared": name in declared, "plugin": None, "ops": [],
                               "python_module": None, "shared_library": None, "error": None}
        if provided is None:
            row["error"] = "no installed plugin provides it"
        else:
            record = provided.record
            bases = {_base(op) for op in record.ops}
            row.update(plugin=provided.plugin.package, python_module=record.python_module,
                       ops=[op for op in ops if _base(op) in bases])
            if record.shared_library is not None:
                try:
                    row["shared_library"] = str(record.shared_library())
                except LlmcoreError as exc:
                    row["error"] = exc.one_line()
        rows.append(row)
    return rows
