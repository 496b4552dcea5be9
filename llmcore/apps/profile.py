"""``llmcore profile OUT.pte --prompt TEXT``: where a program spends its time.

Runs a generation with the runtime's event tracer on (an ETDump), then reads the ETDump
with ExecuTorch's Inspector and prints, for the prefill and for the decode steps apart,
the operators that took the most time: delegated ones under their backend (XNNPACK's own
operators, such as ``Fully Connected (NC, QD8, F32, QB4W) GEMM``, plus the rest of each
delegate call), the others as the runtime's kernels, each linked to the model source line
through the ETRecord when one is given (``llmcore export --etrecord PATH``). Time is
accounted per instruction, so the rows add up to ``Method::execute``.

The per-call times of the generation are measured here and always printed. ExecuTorch 1.5's
runtime records ETDumps; a runtime built without the event tracer records none, and then
the command says so and exits 3. An ETDump recorded elsewhere (``llmcore_runner --etdump
FILE``, a device runner) is analysed with ``--from-etdump FILE``.

Exit codes: 0 with the operator tables, 3 when this runtime records no operator events,
2 for errors the user can act on.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from llmcore.errors import LlmcoreError

EXIT_OK = 0
EXIT_NO_EVENTS = 3

_FRAMEWORK_EVENTS = {"Method::init", "Program::load_method", "Method::execute"}
_KERNEL_PREFIX = "native_call_"
_ETDUMP_ID = b"ED00"
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n[ \t]*([^\n]*)')


# ---- timing the generation ------------------------------------------------------------------


class TimedProgram:
    """A :class:`llmcore.runtime.Program` whose ``logits`` calls are timed."""

    def __init__(self, program: Any):
        self._program = program
        self.calls: list[tuple[int, float]] = []
        """(tokens fed, seconds) per call, in order."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._program, name)

    def logits(self, tokens: Sequence[int], input_pos: Optional[int] = None):
        start = time.perf_counter()
        out = self._program.logits(tokens, input_pos)
        self.calls.append((len(tokens), time.perf_counter() - start))
        return out

    def read_logits(self, tokens: Sequence[int], input_pos: Optional[int], read: Callable[[Any], Any]):
        """As the program's, timed up to ``read`` (the sampling is not the program's time)."""
        start = time.perf_counter()

        def timed_read(row):
            self.calls.append((len(tokens), time.perf_counter() - start))
            return read(row)

        return self._program.read_logits(tokens, input_pos, timed_read)


@dataclass
class CallStats:
    phase: str
    calls: int
    tokens: int
    total_ms: float
    avg_ms: float
    min_ms: float
    max_ms: float


def call_stats(calls: list[tuple[int, float]]) -> list[CallStats]:
    """The first call is the prefill, the others decode steps."""
    out = []
    for phase, part in (("prefill", calls[:1]), ("decode", calls[1:])):
        if not part:
            continue
        times = [s * 1000 for _, s in part]
        out.append(
            CallStats(phase, len(part), sum(n for n, _ in part), sum(times), sum(times) / len(times), min(times), max(times))
        )
    return out


def write_etdump(module: Any, path: Path) -> bool:
    """Write the ETDump the module collected to ``path``; False when it collected none (a
    runtime built without the event tracer writes nothing)."""
    from llmcore.runtime import captured_stderr

    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    with captured_stderr():
        try:
            module.write_etdump_result_to_file(str(partial))
        except Exception:
            pass
    if partial.is_file() and partial.stat().st_size > 0:
        os.replace(partial, path)
        return True
    partial.unlink(missing_ok=True)
    return False


# ---- reading the ETDump ---------------------------------------------------------------------


@dataclass
class OperatorTime:
    name: str
    where: str
    """The backend id for delegated work, else ``kernel`` (the runtime's own kernels)."""
    delegated: bool
    calls: int = 0
    total_ms: float = 0.0
    source: str = ""
    _best: float = field(default=-1.0, repr=False)

    @property
    def avg_ms(self) -> float:
        return self.total_ms / self.calls if self.calls else 0.0

    def add(self, times_ms: Sequence[float], source: str) -> None:
        self.calls += len(times_ms)
        total = float(sum(times_ms))
        self.total_ms += total
        if source and total > self._best:  # the source of the costliest instance
            self.source, self._best = source, total


@dataclass
class Profile:
    """Operator times over a set of ``forward`` runs (one phase of a generation, or all)."""

    operators: list[OperatorTime]
    runs: int
    execute_ms: float
    """Total time in ``Method::execute`` over these runs (0 if the ETDump has none)."""
    etrecord: Optional[str]
    phase: str = "all"

    @property
    def operator_ms(self) -> float:
        return sum(o.total_ms for o in self.operators)

    def by_backend(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for o in self.operators:
            key = o.where if o.delegated else "not delegated"
            out[key] = out.get(key, 0.0) + o.total_ms
        return out


@dataclass
class _Instruction:
    kind: str
    """``kernel`` or ``delegate``."""
    name: str
    """Operator name (``aten::add.out``) or the delegate's backend id."""


def _plan_instructions(pte: bytes, method: str = "forward") -> dict[int, _Instruction]:
    from llmcore.runtime.pte import read_methods

    plans = {p.name: p for p in read_methods(pte)}
    plan = plans.get(method) or next(iter(plans.values()))
    chain = plan.chains[0] if plan.chains else []
    return {i: _Instruction(ins.kind, ins.name) for i, ins in enumerate(chain) if ins.kind != "other"}


def _method_names(pte: bytes) -> set[str]:
    from llmcore.runtime.pte import read_methods

    return {plan.name for plan in read_methods(pte)}


def _same_op(event_name: str, op_name: str) -> bool:
    """``native_call_add.out`` (codegen kernels) or ``llama::custom_sdpa.out`` (kernels
    registered by hand) against the program's ``aten::add.out``."""
    name = event_name[len(_KERNEL_PREFIX):] if event_name.startswith(_KERNEL_PREFIX) else event_name
    return name.split("::")[-1] == op_name.split("::")[-1]


def _is_library_frame(path: str) -> bool:
    return (
        "site-packages" in path
        or "dist-packages" in path
        or path.startswith(("torch/", "<"))
        or "/torch/" in path
        or "/executorch/" in path
    )


def source_line(stack_traces: dict[str, Optional[str]], op_name: str = "") -> str:
    """``file.py:LINE code`` of the innermost model frame of an event's nodes."""
    base = op_name.split("::")[-1].split(".")[0].lower()
    traces = [(node, trace) for node, trace in stack_traces.items() if trace]
    traces.sort(key=lambda item: 0 if base and base in item[0].lower() else 1)
    for _, trace in traces:
        frames = _FRAME.findall(trace)
        model = [f for f in frames if not _is_library_frame(f[0])]
        if model:
            path, line, _, code = model[-1]
            return f"{Path(path).name}:{line} {code.strip()}"
    return ""


def _check_etrecord_matches(etrecord: Any, instructions: dict[int, _Instruction], label: str) -> None:
    """An ETRecord from another export links events to the wrong source lines: refuse it."""
    handles = (getattr(etrecord, "_debug_handle_map", None) or {}).get("forward") or {}
    delegates = (getattr(etrecord, "_delegate_map", None) or {}).get("forward") or {}
    delegate_ids = {i for i, instruction in instructions.items() if instruction.kind == "delegate"}
    if {int(k) for k in delegates} != delegate_ids or not {int(k) for k in handles} <= set(instructions):
        raise LlmcoreError(
            f"ETRecord {label!r} does not match this program (its instructions differ).",
            stage="profile",
            fix="pass the ETRecord that `llmcore export --etrecord` wrote together with this .pte.",
        )


def _inspector(etdump: Path, etrecord: Optional[Path], instructions: dict[int, _Instruction]) -> Any:
    from executorch.devtools import Inspector
    from executorch.devtools.etrecord import parse_etrecord

    parsed = None
    if etrecord is not None:
        try:
            with _quiet():
                parsed = parse_etrecord(str(etrecord))
        except Exception as exc:
            raise LlmcoreError(
                f"ETRecord {str(etrecord)!r} cannot be read ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}).",
                stage="profile",
                fix="pass a file written by `llmcore export --etrecord`, or leave --etrecord out.",
            ) from None
        _check_etrecord_matches(parsed, instructions, str(etrecord))
    data = read_etdump(etdump)
    try:
        with _quiet():
            return Inspector(etdump_data=data, etrecord=parsed)
    except Exception as exc:
        raise LlmcoreError(
            f"{str(etdump)!r} is not a readable ETDump ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}).",
            stage="profile",
            fix="pass the .etdp/.etdump file an ExecuTorch runtime with the event tracer wrote.",
        ) from None


def read_etdump(path: Path) -> bytes:
    """An ETDump's bytes with the size prefix the Inspector expects (added if missing)."""
    data = path.read_bytes()
    fix = "pass the .etdp/.etdump file an ExecuTorch runtime with the event tracer wrote."
    if len(data) >= 12 and data[8:12] == _ETDUMP_ID:
        size = int.from_bytes(data[:4], "little")
        if size > len(data) - 4:
            raise LlmcoreError(
                f"ETDump {str(path)!r} is truncated: its header says {size + 4} bytes, the file has {len(data)}.",
                stage="profile",
                fix=fix,
            )
        return data
    if len(data) >= 8 and data[4:8] == _ETDUMP_ID:  # written without the size prefix
        return len(data).to_bytes(4, "little") + data
    raise LlmcoreError(
        f"{str(path)!r} is not an ETDump (no {_ETDUMP_ID.decode()!r} identifier in its header).",
        stage="profile",
        fix=fix,
    )


@contextlib.contextmanager
def _quiet():
    """The Inspector and ETRecord loader print warnings and deserialisation notes."""
    from llmcore.runtime import captured_stderr

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), captured_stderr():
        warnings.simplefilter("ignore")
        yield


DELEGATE_OVERHEAD = "(outside its operators)"
"""The row for a delegate call's time that none of its operators account for: copying inputs
and outputs, and re-planning a dynamic-shape graph for a new length (XNNPACK's reshape)."""


@dataclass
class _Row:
    name: str
    where: str
    delegated: bool
    per_run: dict[int, list[float]] = field(default_factory=dict)
    sources: list[tuple[float, str]] = field(default_factory=list)

    def add(self, run: int, ms: float, source: str = "") -> None:
        self.per_run.setdefault(run, []).append(ms)
        if source:
            self.sources.append((ms, source))

    def over(self, runs: set[int]) -> Optional[OperatorTime]:
        times = [t for r, ts in self.per_run.items() if r in runs for t in ts]
        if not times:
            return None
        out = OperatorTime(self.name, self.where, self.delegated, calls=len(times), total_ms=float(sum(times)))
        if self.sources:
            out.source = max(self.sources)[1]  # the source of the costliest instance
        return out


def _forward_blocks(inspector: Any) -> list[Any]:
    """The event blocks of ``forward`` runs. Constant methods (``get_max_seq_len``, ...) run
    no instructions, so their blocks hold nothing but framework events."""
    return [b for b in inspector.event_blocks if any(e.name not in _FRAMEWORK_EVENTS for e in b.events)]


def analyze(etdump: Path, pte: bytes, etrecord: Optional[Path] = None, prefill_runs: int = 1) -> dict[str, Profile]:
    """Operator times from an ETDump of ``pte``'s forward method, as profiles of all runs
    (``"all"``) and of the generation's phases: the first ``prefill_runs`` runs are the
    prefill, the rest decode steps (a phase without runs is left out).

    Time is accounted per instruction, so that the rows add up to ``Method::execute`` less
    the interpreter's own work between instructions: a kernel instruction counts its whole
    ``OPERATOR_CALL``; a delegate call is split into the backend's own operator events plus
    one row for the rest of the call (:data:`DELEGATE_OVERHEAD`)."""
    instructions = _plan_instructions(pte)
    inspector = _inspector(etdump, etrecord, instructions)
    rows: dict[tuple[str, str], _Row] = {}
    execute: dict[int, float] = {}
    operator_calls: dict[tuple[int, int], float] = {}  # (run, instruction) -> ms
    kernel_events: dict[tuple[int, int], tuple[float, Any]] = {}
    details: dict[tuple[int, int], list[tuple[float, Any]]] = {}
    delegate_calls: dict[tuple[int, int], float] = {}
    delegate_inside: dict[tuple[int, int], float] = {}
    mismatched = 0

    def row(name: str, where: str, delegated: bool) -> _Row:
        return rows.setdefault((where, name), _Row(name, where, delegated))

    first_run = 0
    for block in _forward_blocks(inspector):
        block_runs = 0
        for event in block.events:
            if event.perf_data is None:
                continue
            raw = list(event.perf_data.raw)
            block_runs = max(block_runs, len(raw))
            instr_id = getattr(event, "_instruction_id", None)
            instruction = instructions.get(instr_id) if instr_id is not None else None
            name, source = str(event.name), ""
            # what the event is: the same in every run, so decided (and its source read) once
            if name == "Method::execute":
                kind = "execute"
            elif name in _FRAMEWORK_EVENTS:
                continue
            elif event.is_delegated_op:
                kind, source = "delegated", source_line(event.stack_traces)
                backend = event.delegate_backend_name or (instruction.name if instruction else "delegate")
            elif name in ("OPERATOR_CALL", "DELEGATE_CALL"):
                kind = name
            elif instruction is not None and instruction.kind == "kernel" and _same_op(name, instruction.name):
                kind = "kernel"
            elif name.startswith(_KERNEL_PREFIX):  # a kernel this program does not call there
                mismatched += 1
                continue
            else:  # an event a kernel logs inside its own call
                kind = "detail"
            for offset, ms in enumerate(raw):
                run, key = first_run + offset, (first_run + offset, instr_id)
                if kind == "execute":
                    execute[run] = execute.get(run, 0.0) + ms
                elif kind == "delegated":
                    row(name, backend, True).add(run, ms, source)
                    delegate_inside[key] = delegate_inside.get(key, 0.0) + ms
                elif kind == "OPERATOR_CALL":
                    operator_calls[key] = ms
                elif kind == "DELEGATE_CALL":
                    delegate_calls[key] = ms
                elif kind == "kernel":
                    kernel_events[key] = (ms, event)
                else:
                    details.setdefault(key, []).append((ms, event))
        first_run += block_runs
    if mismatched:
        raise LlmcoreError(
            f"ETDump {str(etdump)!r} does not match this program ({mismatched} operator events name another "
            "operator than the program has at their instruction).",
            stage="profile",
            fix="pass the .pte that the ETDump was recorded with.",
        )

    def kernel_name(instr_id: Optional[int]) -> str:
        instruction = instructions.get(instr_id) if instr_id is not None else None
        return instruction.name if instruction else f"instruction {instr_id}"

    # kernels: the whole OPERATOR_CALL where there is one (the kernel's own event and what it
    # logs inside are nested in it), else the kernel's event, else what it logged
    timed = set(operator_calls) | set(kernel_events)
    sources: dict[Optional[int], str] = {}  # per instruction: the same in every run
    for run, instr_id in timed:
        name = kernel_name(instr_id)
        ms, event = kernel_events.get((run, instr_id), (None, None))
        if (run, instr_id) in operator_calls:
            ms = operator_calls[(run, instr_id)]
        if instr_id not in sources:
            sources[instr_id] = source_line(event.stack_traces, name) if event is not None else ""
        row(name, "kernel", False).add(run, ms, sources[instr_id])
    for (run, instr_id), events in details.items():
        if (run, instr_id) not in timed:
            for ms, event in events:
                row(str(event.name), "kernel", False).add(run, ms, source_line(event.stack_traces, str(event.name)))
    for (run, instr_id), ms in delegate_calls.items():
        backend = instructions[instr_id].name if instr_id in instructions else "delegate"
        inside = delegate_inside.get((run, instr_id))
        if inside is None:
            row("(whole delegate)", backend, True).add(run, ms)
        else:
            row(DELEGATE_OVERHEAD, backend, True).add(run, max(ms - inside, 0.0))

    runs = sorted(set(execute) | {r for row_ in rows.values() for r in row_.per_run})
    phases = {"all": set(runs), "prefill": set(runs[:prefill_runs]), "decode": set(runs[prefill_runs:])}
    out: dict[str, Profile] = {}
    for phase, selected in phases.items():
        if not selected and phase != "all":
            continue
        operators = [o for o in (r.over(selected) for r in rows.values()) if o is not None]
        operators.sort(key=lambda o: -o.total_ms)
        execute_ms = sum(ms for r, ms in execute.items() if r in selected)
        out[phase] = Profile(operators, len(selected), execute_ms, str(etrecord) if etrecord else None, phase)
    return out


# ---- output ---------------------------------------------------------------------------------


def format_calls(stats: list[CallStats], generated: int) -> str:
    lines = [f"{'calls':<8} {'count':>5} {'tokens':>6} {'total ms':>9} {'avg ms':>8} {'min ms':>8} {'max ms':>8}"]
    for s in stats:
        lines.append(
            f"{s.phase:<8} {s.calls:>5} {s.tokens:>6} {s.total_ms:>9.2f} {s.avg_ms:>8.3f} {s.min_ms:>8.3f} {s.max_ms:>8.3f}"
        )
    decode = next((s for s in stats if s.phase == "decode"), None)
    if decode and decode.total_ms > 0:
        lines.append(f"decode {decode.calls / decode.total_ms * 1000:.1f} tok/s over {generated} generated tokens")
    return "\n".join(lines)


def format_profile(profile: Profile, top: int) -> str:
    total = profile.operator_ms
    shown = profile.operators[:top]
    head = f"top {len(shown)} of {len(profile.operators)} operators by total time"
    if profile.phase != "all":
        head = f"{profile.phase}: {head}"
    if profile.runs:
        runs = f"{profile.runs} run" + ("s" if profile.runs != 1 else "")
        head += f" ({runs}, {profile.execute_ms:.3f} ms in Method::execute)"
    lines = [head]
    if not profile.operators:
        lines.append("  (the ETDump has no operator events)")
        return "\n".join(lines)
    name_w = min(max(len(o.name) for o in shown), 50)
    where_w = max(len("runs on"), *(len(o.where) for o in shown))
    lines.append(
        f"{'total ms':>9} {'share':>6} {'calls':>6} {'avg ms':>8}  {'runs on':<{where_w}}  {'operator':<{name_w}}  source"
    )
    for o in shown:
        share = 100 * o.total_ms / total if total else 0.0
        name = o.name if len(o.name) <= name_w else o.name[: name_w - 3] + "..."
        source = o.source if len(o.source) <= 90 else o.source[:87] + "..."
        lines.append(
            f"{o.total_ms:>9.3f} {share:>5.1f}% {o.calls:>6} {o.avg_ms:>8.4f}  {o.where:<{where_w}}  "
            f"{name:<{name_w}}  {source or '-'}".rstrip()
        )
    parts = []
    for key, ms in sorted(profile.by_backend().items(), key=lambda kv: -kv[1]):
        parts.append(f"{key} {100 * ms / total if total else 0:.1f}%")
    summary = f"operator time {total:.3f} ms: " + ", ".join(parts)
    if profile.execute_ms:
        summary += f" ({100 * total / profile.execute_ms:.0f}% of Method::execute)"
    lines.append(summary)
    lines.append(
        "kernel = the runtime's own kernels (not delegated); "
        + ("source lines from the ETRecord" if profile.etrecord else "pass --etrecord for source lines")
    )
    return "\n".join(lines)


def _profile_json(profile: Profile) -> dict[str, Any]:
    return {
        "runs": profile.runs,
        "execute_ms": profile.execute_ms,
        "operators": [
            {k: v for k, v in asdict(o).items() if not k.startswith("_")} | {"avg_ms": o.avg_ms}
            for o in profile.operators
        ],
        "by_backend_ms": profile.by_backend(),
    }


# ---- command --------------------------------------------------------------------------------


def _no_tracer_note(pte: str, etrecord: Optional[str]) -> str:
    return (
        "llmcore profile: this ExecuTorch runtime was built without the event tracer "
        "(EXECUTORCH_ENABLE_EVENT_TRACER), so it records no operator events: only the per-call times above. "
        "Record an ETDump with a runtime built with it (e.g. on the device) and analyse it here with "
        f"`llmcore profile {pte} --from-etdump FILE --etrecord {etrecord or 'ETRECORD'}`."
    )


def cmd_profile(args: argparse.Namespace) -> int:
    pte = Path(args.pte)
    if args.top < 1:
        raise LlmcoreError("--top must be at least 1.", stage="cli", fix="pass a positive --top.")
    if args.max_new_tokens < 1:
        raise LlmcoreError("--max-new-tokens must be at least 1.", stage="cli", fix="pass a positive --max-new-tokens.")
    for flag, value in (("--etrecord", args.etrecord), ("--from-etdump", args.from_etdump)):
        if value and not Path(value).is_file():
            raise LlmcoreError(f"{flag} {value!r} does not exist.", stage="profile", fix=f"check the path given to {flag}.")
    if args.from_etdump:
        from llmcore.runtime.pte import read_head

        if args.prefill_runs < 0:
            raise LlmcoreError("--prefill-runs must be 0 or more.", stage="cli", fix="pass e.g. --prefill-runs 1.")
        data = read_head(pte, stage="inspect")
        etrecord = Path(args.etrecord) if args.etrecord else None
        _print(args, profiles=analyze(Path(args.from_etdump), data, etrecord, args.prefill_runs))
        return EXIT_OK
    if args.prompt is None:
        raise LlmcoreError(
            "llmcore profile needs --prompt (or --from-etdump FILE to analyse a recorded ETDump).",
            stage="cli",
            fix="pass e.g. --prompt 'Hello'.",
        )

    from llmcore.runtime.generate import Sampling, TextTokenizer, generate, prompt_ids_for, tokenizer_beside
    from llmcore.runtime import Program

    etdump = Path(args.etdump) if args.etdump else pte.with_suffix(".etdump")
    if not etdump.resolve().parent.is_dir():
        raise LlmcoreError(
            f"the folder of --etdump {str(etdump)!r} does not exist.", stage="profile", fix="create it first."
        )
    program = TimedProgram(Program.load(pte, enable_etdump=True))
    tokenizer = TextTokenizer.from_file(args.tokenizer or tokenizer_beside(pte))
    ids = prompt_ids_for(program, tokenizer, args.prompt)
    result = generate(program, ids, args.max_new_tokens, Sampling())
    stats = call_stats(program.calls)
    if not write_etdump(program.module, etdump):
        _print(args, stats=stats, generated=len(result.generated_ids), note=_no_tracer_note(args.pte, args.etrecord))
        return EXIT_NO_EVENTS
    from llmcore.runtime.pte import read_head

    prefill_runs = next((s.calls for s in stats if s.phase == "prefill"), 0)
    data = read_head(pte, stage="inspect")
    profiles = analyze(etdump, data, Path(args.etrecord) if args.etrecord else None, prefill_runs)
    _print(args, stats=stats, generated=len(result.generated_ids), profiles=profiles, etdump=str(etdump))
    return EXIT_OK


def _print(
    args: argparse.Namespace,
    *,
    stats: Optional[list[CallStats]] = None,
    generated: int = 0,
    profiles: Optional[dict[str, Profile]] = None,
    etdump: Optional[str] = None,
    note: Optional[str] = None,
) -> None:
    """The per-call times, then one operator table per phase (prefill, decode); the JSON form
    carries all runs at the top level and each phase under ``phases``."""
    phases = {k: v for k, v in (profiles or {}).items() if k != "all"}
    if args.json:
        data: dict[str, Any] = {"calls": [asdict(s) for s in stats] if stats is not None else None}
        data["operator_events"] = profiles is not None
        if profiles is not None:
            data.update(_profile_json(profiles["all"]))
            data["phases"] = {phase: _profile_json(p) for phase, p in phases.items()}
        data["etdump"] = etdump or args.from_etdump
        data["etrecord"] = args.etrecord
        if note:
            data["note"] = note
        print(json.dumps(data, indent=2))
    else:
        blocks = []
        if stats is not None:
            blocks.append(format_calls(stats, generated))
        blocks.extend(format_profile(p, args.top) for p in (phases or {"all": profiles["all"]} if profiles else {}).values())
        if etdump:
            blocks.append(f"ETDump: {etdump}")
        print("\n\n".join(blocks))
    if note:
        print(note, file=sys.stderr)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Run a generation with the runtime's event tracer on and print, for the prefill and the "
        "decode steps apart, the operators that took the most time (from the ETDump, through ExecuTorch's "
        "Inspector), delegated ones under their backend, "
        "linked to model source lines through an ETRecord (`llmcore export --etrecord PATH`). Per-call "
        "prefill/decode times are always printed.")
    p.epilog = (
        "exit status: 0 with the operator table; 3 when this ExecuTorch runtime was built without the "
        "event tracer and records no operator events (the per-call times are still printed; analyse an ETDump "
        "recorded elsewhere with --from-etdump); 2 for errors.")
    p.add_argument("pte", help="the .pte program")
    p.add_argument("--prompt", help="the prompt to generate from (required unless --from-etdump)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--tokenizer", help="tokenizer.json (default: the one next to the .pte)")
    p.add_argument("--etrecord", help="ETRecord from `llmcore export --etrecord`, to link operators to source lines")
    p.add_argument("--etdump", help="where to write the ETDump (default: OUT.etdump next to the .pte)")
    p.add_argument("--from-etdump", metavar="ETDUMP", help="analyse this recorded ETDump instead of running "
                   "(e.g. one `llmcore_runner --etdump FILE` wrote)")
    p.add_argument("--prefill-runs", type=int, default=1, metavar="N",
                   help="with --from-etdump: how many leading forward runs were the prefill (default 1); "
                   "the rest are tabled as decode steps")
    p.add_argument("--top", type=int, default=15, help="how many operators to list (default 15)")
    p.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    return p
