"""``llmcore inspect OUT.pte``: what a program needs, and whether this runtime has it.

A preflight that answers before a device does (``Missing operator ... error 0x14``,
``Backend ... is not registered``): the program's methods with their inputs and outputs,
the metadata values of ``docs/pte-contract.md``, the backends its delegates need and the
operators it calls outside them, each checked against the ExecuTorch runtime of this
environment (after loading the runtime libraries that register its operators:
:func:`llmcore.runtime.libraries.load_libraries_for`).

The program is read from its flatbuffer, not run: inspecting a program lowered for a
backend this runtime lacks is safe.

Exit codes: 0 when everything the program needs is available here, 3 when a backend or an
operator is missing, 2 when the file is not a readable ExecuTorch program.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from llmcore.runtime import pte
from llmcore.errors import LlmcoreError
from llmcore.runtime.pte import ValueInfo

EXIT_OK = 0
EXIT_MISSING = 3

# Operator namespaces, by what the user has to do to get their kernels.
_QUANTIZED_NAMESPACES = {"quantized_decomposed", "quantized", "torchao"}
_RUNTIME_NAMESPACES = {"aten", "executorch_prim", "dim_order_ops", "et_copy"}
_KIND_ORDER = {"custom": 0, "quantized": 1, "aten": 2, "runtime": 3}

@dataclass
class MethodInfo:
    name: str
    inputs: list[ValueInfo]
    outputs: list[ValueInfo]
    kernel_calls: int
    delegate_calls: int
    delegates: dict[str, int]
    """Backend id -> number of delegates of this method."""


@dataclass
class OperatorInfo:
    name: str
    """``namespace::op.overload``, as the runtime registers it."""
    kind: str
    """``custom``, ``quantized``, ``aten`` or ``runtime`` (ExecuTorch's own primitives)."""
    calls: int
    methods: list[str]
    available: Optional[bool] = None


@dataclass
class BackendInfo:
    id: str
    delegates: int
    methods: list[str]
    runs_on: str
    available: Optional[bool] = None


@dataclass
class Inspection:
    path: str
    bytes: int
    format: str
    methods: list[MethodInfo]
    metadata: dict[str, Any]
    metadata_missing: list[str]
    backends: list[BackendInfo]
    operators: list[OperatorInfo]
    runtime: dict[str, Any] = field(default_factory=dict)
    runtime_libraries: list[dict[str, Any]] = field(default_factory=list)
    """Kernel libraries the program needs (declared in it, or providing its operators)."""

    @property
    def missing_backends(self) -> list[BackendInfo]:
        return [b for b in self.backends if b.available is False]

    @property
    def missing_operators(self) -> list[OperatorInfo]:
        return [o for o in self.operators if o.available is False]

    @property
    def ok(self) -> bool:
        return not self.missing_backends and not self.missing_operators

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["missing"] = {
            "backends": [b.id for b in self.missing_backends],
            "operators": [o.name for o in self.missing_operators],
        }
        data["ok"] = self.ok
        return data


# ---- reading the program ------------------------------------------------------------------


def _error(message: str, fix: str) -> LlmcoreError:
    return LlmcoreError(message, stage="inspect", fix=fix)


def verify_with_runtime(path: str | Path, label: str) -> None:
    """Let the runtime check the program's internal consistency (no method is loaded, so no
    backend is initialised: safe for programs this runtime cannot run)."""
    from llmcore.runtime.libraries import runtime_bindings
    from llmcore.runtime import captured_stderr

    bindings = runtime_bindings()
    with captured_stderr() as log:
        try:
            bindings._load_program(
                str(path), program_verification=bindings.Verification.InternalConsistency
            )
            failure = None
        except Exception as exc:
            failure = exc
    if failure is not None:
        lines = [ln.split("]", 1)[-1].strip() for ln in log.text().splitlines() if ln.strip() and "cpuinfo" not in ln]
        reason = "; ".join([*lines[:2], str(failure)])[:300]
        raise _error(
            f"{label!r} is damaged: the ExecuTorch runtime rejects it ({reason}).",
            "export it again with `llmcore export`.",
        )


def _operator_kind(name: str) -> str:
    namespace = name.split("::", 1)[0]
    if namespace in _RUNTIME_NAMESPACES:
        return "aten" if namespace == "aten" else "runtime"
    if namespace in _QUANTIZED_NAMESPACES:
        return "quantized"
    return "custom"


def describe(data: bytes, label: str, file_size: Optional[int] = None) -> Inspection:
    """Methods, metadata, delegates and operators of a serialized program (not yet checked
    against the runtime); ``data`` needs to hold the program table, not the weights."""
    try:
        methods = pte.read_methods(data)
    except Exception as exc:
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise _error(
            f"{label!r} is damaged: its program table cannot be read ({type(exc).__name__}: {reason}).",
            "export it again with `llmcore export`.",
        ) from None
    return _describe(methods, data, label, len(data) if file_size is None else file_size)


def _describe(program: list[pte.Method], data: bytes, label: str, file_size: int) -> Inspection:
    from llmcore.runtime import METADATA_METHODS, backend_target

    methods: list[MethodInfo] = []
    metadata: dict[str, Any] = {}
    op_calls: Counter = Counter()
    op_methods: dict[str, list[str]] = {}
    backend_counts: Counter = Counter()
    backend_methods: dict[str, list[str]] = {}
    for plan in program:
        calls = Counter(i.kind for chain in plan.chains for i in chain)
        for instruction in (i for chain in plan.chains for i in chain if i.kind == "kernel"):
            op_calls[instruction.name] += 1
            if plan.name not in op_methods.setdefault(instruction.name, []):
                op_methods[instruction.name].append(plan.name)
        delegates = Counter(plan.delegates)
        for backend, count in delegates.items():
            backend_counts[backend] += count
            backend_methods.setdefault(backend, []).append(plan.name)
        methods.append(
            MethodInfo(plan.name, plan.inputs, plan.outputs, calls["kernel"], calls["delegate"], dict(delegates))
        )
        if plan.constants is not None:
            values = plan.constants
            metadata[plan.name] = values if METADATA_METHODS.get(plan.name) is list or len(values) > 1 else values[0]
    operators = [
        OperatorInfo(name, _operator_kind(name), op_calls[name], op_methods[name]) for name in op_calls
    ]
    operators.sort(key=lambda o: (_KIND_ORDER[o.kind], o.name))
    backends = [
        BackendInfo(b, backend_counts[b], backend_methods[b], backend_target(b)) for b in sorted(backend_counts)
    ]
    is_llm = "forward" in {m.name for m in methods} and bool(set(metadata) & set(METADATA_METHODS))
    missing_meta = [m for m in METADATA_METHODS if m not in metadata] if is_llm else []
    return Inspection(
        path=label,
        bytes=file_size,
        format=bytes(data[4:8]).decode("ascii", "replace"),
        methods=methods,
        metadata=metadata,
        metadata_missing=missing_meta,
        backends=backends,
        operators=operators,
    )


def check_runtime(inspection: Inspection) -> Inspection:
    """Mark each backend and operator as available (or not) in this process's runtime."""
    from llmcore.runtime.libraries import load_libraries_for, runtime_bindings, unregistered

    bindings = runtime_bindings()
    libraries = load_libraries_for(unregistered([op.name for op in inspection.operators]), stage="inspect",
                                   skip_failures=True)
    backends = set(bindings._get_registered_backend_names())
    operators = set(bindings._get_operator_names())
    for backend in inspection.backends:
        backend.available = backend.id in backends
    for op in inspection.operators:
        op.available = op.name in operators
    inspection.runtime = {
        "libraries": libraries,
        "backends": sorted(backends),
        "operators": len(operators),
    }
    return inspection


def inspect_program(path: str | Path, *, verify: bool = True) -> Inspection:
    """Read, describe and check a `.pte` against this runtime."""
    label = str(path)
    data = pte.read_head(path, stage="inspect")
    from llmcore.runtime import libraries

    try:  # the plugin libraries a program needs are loaded first, as `llmcore run` does
        libraries.load_program_libraries(data)
    except LlmcoreError:
        pass  # reported below as a requirement, and its operators as missing
    if verify:
        verify_with_runtime(path, label)
    inspection = check_runtime(describe(data, label, Path(path).stat().st_size))
    try:
        inspection.runtime_libraries = libraries.runtime_library_requirements(data)
    except Exception:  # a description of requirements must not fail the inspection
        inspection.runtime_libraries = []
    return inspection


# ---- output ---------------------------------------------------------------------------------


_KIND_NOTES = {
    "custom": "custom op",
    "quantized": "quantized op",
    "aten": "",
    "runtime": "ExecuTorch primitive",
}

_LIBRARY_HINTS = {
    "llama": "ExecuTorch's LLM custom ops (Python: executorch.extension.llm.custom_ops; C++: link custom_ops)",
    "quantized_decomposed": "ExecuTorch's quantized kernels (Python: executorch.kernels.quantized; C++: link quantized_ops_lib)",
}


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def format_text(ins: Inspection) -> str:
    from llmcore.runtime import METADATA_METHODS

    lines = [f"program  {ins.path}  ({_size(ins.bytes)}, format {ins.format})", ""]
    lines.append("methods")
    width = max([len(m.name) for m in ins.methods] + [8])
    for m in ins.methods:
        if m.name in ins.metadata:
            continue
        ins_text = ", ".join(v.text() for v in m.inputs) or "-"
        outs_text = ", ".join(v.text() for v in m.outputs) or "-"
        lines.append(f"  {m.name:<{width}}  ({ins_text}) -> {outs_text}")
        calls = f"{m.kernel_calls} operator calls"
        if m.delegates:
            per = ", ".join(f"{n} {b}" for b, n in sorted(m.delegates.items()))
            calls += f", {m.delegate_calls} delegate calls ({per})"
        lines.append(f"  {'':<{width}}  {calls}")
    constant = [m for m in ins.methods if m.name in ins.metadata]
    if constant:
        lines.append(f"  + {len(constant)} constant methods (metadata below)")
    lines.append("")

    if ins.metadata:
        lines.append("metadata (constant methods, docs/pte-contract.md)")
        mwidth = max(len(k) for k in ins.metadata)
        ordered = [k for k in METADATA_METHODS if k in ins.metadata] + sorted(
            k for k in ins.metadata if k not in METADATA_METHODS
        )
        for key in ordered:
            lines.append(f"  {key:<{mwidth}}  {ins.metadata[key]}")
        if ins.metadata_missing:
            lines.append(f"  missing: {', '.join(ins.metadata_missing)}")
    else:
        lines.append("metadata: none (no constant methods: not a program `llmcore export` wrote)")
    lines.append("")

    if ins.backends:
        lines.append("backends (delegates)")
        bwidth = max(len(b.id) for b in ins.backends)
        for b in ins.backends:
            status = "available" if b.available else "MISSING"
            count = f"{b.delegates} delegate" + ("" if b.delegates == 1 else "s")
            lines.append(f"  {b.id:<{bwidth}}  {count:>12}  {status:<9}  runs on {b.runs_on}")
    else:
        lines.append("backends: none (no delegates: every operator runs on the portable runtime)")
    lines.append("")

    total_calls = sum(o.calls for o in ins.operators)
    lines.append(f"operators outside delegates ({len(ins.operators)} operators, {total_calls} calls)")
    if ins.operators:
        owidth = max(len(o.name) for o in ins.operators)
        for o in ins.operators:
            status = "ok" if o.available else "MISSING"
            note = _KIND_NOTES[o.kind]
            calls = f"{o.calls} call" + ("" if o.calls == 1 else "s")
            lines.append(f"  {o.name:<{owidth}}  {calls:>9}  {status:<7}  {note}".rstrip())
    special = [o for o in ins.operators if o.kind in ("custom", "quantized")]
    if special:
        names = sorted({o.name.split("::", 1)[0] for o in special})
        lines.append("  custom and quantized ops come from: " + "; ".join(
            f"{ns}:: {_LIBRARY_HINTS.get(ns, 'a kernel library the exporting plugin names')}" for ns in names
        ))
    lines.append("")

    if ins.runtime_libraries:
        lines.append("runtime libraries the program needs")
        for lib in ins.runtime_libraries:
            where = lib.get("shared_library") or lib.get("error") or ""
            plugin = f"from plugin {lib['plugin']}" if lib.get("plugin") else "no plugin here provides it"
            lines.append(f"  {lib['name']}  {plugin}  {where}".rstrip())
        lines.append("")

    runtime = ins.runtime
    lines.append(
        f"runtime here: backends {', '.join(runtime.get('backends', [])) or 'none'}; "
        f"{runtime.get('operators', 0)} operators"
    )
    if ins.ok:
        lines.append("OK: this runtime has every backend and operator the program needs.")
    else:
        problems = [f"backend {b.id}, which runs on {b.runs_on}" for b in ins.missing_backends]
        problems += [f"operator {o.name}" for o in ins.missing_operators]
        lines.append("MISSING: " + "; ".join(problems) + ".")
        lines.append("  `llmcore run` and ExecuTorch runtimes without them cannot load this program.")
    return "\n".join(lines)


# ---- command --------------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
    inspection = inspect_program(args.pte)
    if args.json:
        print(json.dumps(inspection.as_dict(), indent=2))
    else:
        print(format_text(inspection))
    return EXIT_OK if inspection.ok else EXIT_MISSING


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Preflight for a .pte: its methods with their inputs and outputs, its metadata, the "
        "backends its delegates need and the operators it calls outside them, each checked against the "
        "ExecuTorch runtime of this environment. The program is read, not run.")
    p.epilog = (
        "exit status: 0 when this runtime has everything the program needs; 3 when a backend or "
        "an operator is missing (they are listed); 2 when the file is not a readable ExecuTorch program.")
    p.add_argument("pte", help="the .pte program")
    p.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    return p
