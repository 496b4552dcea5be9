"""`llmcore profile` as a user runs it.

The shipped runtime (ExecuTorch 1.5) records ETDumps, so a profiled generation must give the
operator tables, checked against what the exported program is known to contain: every
delegated linear once per run under XNNPACK, every kernel instruction under its operator
name, and rows that add up to ``Method::execute``.

The accounting itself is pinned on an ETDump with known times, made here in the layout the
runtime writes (``Method::execute``, ``OPERATOR_CALL`` + ``native_call_<op>`` per kernel
instruction, the full name for kernels registered by hand, ``DELEGATE_CALL`` plus the
backend's own events per delegate instruction) and read back through the real Inspector
and the real ETRecord that `llmcore export` wrote.
"""

from __future__ import annotations

import json
import struct

import pytest

from clitools import run_cli
from llmcore.apps.profile import DELEGATE_OVERHEAD

TINY = ["export", "--model", "nanogpt", "--config", "tiny"]
XNNPACK_OPS = ("Fully Connected (NC, F32) GEMM", "Add (ND, F32)")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profile")
    pte, etrecord = folder / "tiny.pte", folder / "tiny.etrecord"
    result = run_cli(*TINY, "--plugins", "xnnpack", "--etrecord", str(etrecord), "--quiet", "-o", str(pte))
    assert result.returncode == 0, result.stderr
    etdump = folder / "tiny.etdp"
    etdump.write_bytes(_etdump_for(pte.read_bytes(), runs=3))
    return {"pte": pte, "etrecord": etrecord, "etdump": etdump, "folder": folder}


def _event(name, instruction, start, duration, delegate_name=""):
    from executorch.devtools.etdump import schema_flatcc as s

    profile = s.ProfileEvent(
        name=name, chain_index=0, instruction_id=instruction, delegate_debug_id_int=-1,
        delegate_debug_id_str=delegate_name, delegate_debug_metadata=None,
        start_time=start, end_time=start + duration,
    )
    return s.Event(profile_event=profile, allocation_event=None, debug_event=None)


def _etdump_for(pte: bytes, runs: int) -> bytes:
    """A size-prefixed ETDump of ``runs`` forward calls of ``pte``; kernel ``op_index`` k
    takes (k + 1) us, each XNNPACK op i of every delegate (i + 1) * 20 us."""
    from executorch.devtools.etdump import schema_flatcc as s
    from executorch.devtools.etdump.serialize import serialize_to_etdump_flatcc
    from executorch.exir import schema

    from llmcore.runtime.pte import read_program_table

    plan = next(p for p in read_program_table(pte).execution_plan if p.name == "forward")
    run_data = []
    for _ in range(runs):
        now, events = 1_000, []
        for index, instruction in enumerate(plan.chains[0].instructions):
            args = instruction.instr_args
            if isinstance(args, schema.KernelCall):
                op = plan.operators[args.op_index]
                took = 1_000 * (args.op_index + 1)
                events.append(_event("OPERATOR_CALL", index, now, took + 50))
                kernel = op.name.split("::")[1] + (f".{op.overload}" if op.overload else "")
                if op.name.startswith(("aten::", "executorch_prim::")):  # codegen-registered kernels
                    events.append(_event(f"native_call_{kernel}", index, now + 10, took))
                else:  # kernels registered by hand carry their full name, and may time their insides
                    events.append(_event(f"{op.name}.{op.overload}", index, now + 10, took))
                    events.append(_event("inner_loop", index, now + 20, took // 2))
                now += took + 60
            elif isinstance(args, schema.DelegateCall):
                start = now
                for i, name in enumerate(XNNPACK_OPS):
                    events.append(_event(None, index, now, 20_000 * (i + 1), delegate_name=name))
                    now += 20_000 * (i + 1) + 10
                events.append(_event("DELEGATE_CALL", index, start, now - start + 100))
                now += 120
        events.insert(0, _event("Method::execute", -1, 900, now - 800))
        run_data.append(s.RunData(name="forward", bundled_input_index=-1, allocators=[], events=events))
    data = serialize_to_etdump_flatcc(s.ETDumpFlatCC(version=0, run_data=run_data))
    return struct.pack("<I", len(data)) + data


def _profile_json(*args):
    result = run_cli("profile", *args, "--json")
    return result, json.loads(result.stdout) if result.stdout.strip() else None


def _one_line_error(result, expected):
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert expected in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def _delegated_linears(pte) -> int:
    report = json.loads(pte.with_name(pte.stem + ".report.json").read_text())
    return next(o["delegated"] for o in report["delegation"]["operators"] if o["op_type"] == "aten_linear_default")


def _kernel_instructions(pte) -> set:
    from llmcore.apps.profile import _plan_instructions

    return {i.name for i in _plan_instructions(pte.read_bytes()).values() if i.kind == "kernel"}


def test_profile_a_generation(exported):
    etdump = exported["folder"] / "run.etdump"
    result = run_cli(
        "profile", str(exported["pte"]), "--prompt", "Hello", "--max-new-tokens", "6",
        "--etrecord", str(exported["etrecord"]), "--etdump", str(etdump),
    )
    assert result.returncode == 0, result.stderr
    assert "prefill" in result.stdout and "decode" in result.stdout and "tok/s" in result.stdout
    assert "prefill: top 15 of " in result.stdout and "(1 run, " in result.stdout
    assert "decode: top 15 of " in result.stdout and "(5 runs, " in result.stdout
    assert "Fully Connected" in result.stdout and "XnnpackBackend" in result.stdout
    assert "model.py:" in result.stdout  # linked to the nanoGPT source by the ETRecord
    assert etdump.is_file() and not list(exported["folder"].glob("*.partial"))


def test_live_profile_matches_the_program(exported):
    """The operator mix of the tiny nanoGPT is known: its report counts the delegated
    linears, its plan the kernel instructions. Each phase's table must show all of them,
    once per run, and its rows must add up to the time spent in ``Method::execute``."""
    pte = exported["pte"]
    result, data = _profile_json(str(pte), "--prompt", "Hello there", "--max-new-tokens", "5")
    assert result.returncode == 0, result.stderr
    assert data["operator_events"] is True and data["runs"] == 5
    calls = {c["phase"]: c for c in data["calls"]}
    assert calls["prefill"]["calls"] == 1 and calls["decode"]["calls"] == 4
    assert all(c["total_ms"] > 0 for c in data["calls"])
    linears, kernels = _delegated_linears(pte), _kernel_instructions(pte)
    assert linears >= 8
    assert {p: d["runs"] for p, d in data["phases"].items()} == {"prefill": 1, "decode": 4}
    for phase, found in data["phases"].items():
        ops = found["operators"]
        gemms = [o for o in ops if o["where"] == "XnnpackBackend" and o["name"].startswith("Fully Connected")]
        assert sum(o["calls"] for o in gemms) == linears * found["runs"], phase
        not_delegated = {o["name"] for o in ops if not o["delegated"]}
        assert not_delegated == kernels, phase
        counted = sum(o["total_ms"] for o in ops)
        assert 0.8 * found["execute_ms"] <= counted <= found["execute_ms"] * 1.0001, (phase, counted, found["execute_ms"])
    # the phases partition the runs
    total = sum(o["total_ms"] for o in data["operators"])
    by_phase = sum(o["total_ms"] for p in data["phases"].values() for o in p["operators"])
    assert by_phase == pytest.approx(total)


def test_operator_table_from_an_etdump_with_source_lines(exported):
    result = run_cli(
        "profile", str(exported["pte"]), "--from-etdump", str(exported["etdump"]),
        "--etrecord", str(exported["etrecord"]), "--top", "6", "--prefill-runs", "0",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("decode: top 6 of ") and "3 runs" in lines[0]
    table = lines[2:8]
    # the delegate's own events come first (they are the slowest here), under their backend
    assert "XnnpackBackend" in table[0] and "Add (ND, F32)" in table[0]
    assert "XnnpackBackend" in table[1] and "Fully Connected (NC, F32) GEMM" in table[1]
    kernel_rows = [row for row in table if "  kernel  " in row]
    assert kernel_rows, table
    assert any("model.py:" in row for row in kernel_rows)  # linked to the nanoGPT source by the ETRecord
    assert "XnnpackBackend" in lines[8] and "not delegated" in lines[8]


def test_operator_times_add_up(exported):
    result, data = _profile_json(
        str(exported["pte"]), "--from-etdump", str(exported["etdump"]), "--etrecord", str(exported["etrecord"])
    )
    assert result.returncode == 0, result.stderr
    ops = data["operators"]
    assert [o["total_ms"] for o in ops] == sorted((o["total_ms"] for o in ops), reverse=True)
    assert data["runs"] == 3
    delegated = [o for o in ops if o["delegated"]]
    assert {o["where"] for o in delegated} == {"XnnpackBackend"}
    assert {o["name"] for o in delegated} == set(XNNPACK_OPS) | {DELEGATE_OVERHEAD}
    n_delegates = delegated[0]["calls"] // 3
    add = next(o for o in delegated if o["name"] == "Add (ND, F32)")
    assert add["avg_ms"] == pytest.approx(0.040)  # 40 us per call, in ms
    assert add["total_ms"] == pytest.approx(0.040 * 3 * n_delegates)
    # the delegate call lasts 120 ns longer than its two operators: 2 gaps of 10 ns, 100 ns after
    overhead = next(o for o in delegated if o["name"] == DELEGATE_OVERHEAD)
    assert overhead["calls"] == 3 * n_delegates and overhead["avg_ms"] == pytest.approx(0.000120)
    # a kernel instruction counts its whole OPERATOR_CALL: (op_index + 1) us of work + 50 ns
    for o in ops:
        if not o["delegated"]:
            work_us = (o["avg_ms"] - 0.000050) * 1000
            assert work_us == pytest.approx(round(work_us)) and round(work_us) >= 1, o
    # phases: the first run is the prefill, the other two decode steps; they partition the rows
    assert {p: d["runs"] for p, d in data["phases"].items()} == {"prefill": 1, "decode": 2}
    by_phase = sum(o["total_ms"] for d in data["phases"].values() for o in d["operators"])
    assert by_phase == pytest.approx(sum(o["total_ms"] for o in ops))
    # every kernel instruction appears once per run, under the program's own operator names
    kernels = [o for o in ops if not o["delegated"]]
    assert all("::" in o["name"] for o in kernels)
    assert sum(data["by_backend_ms"].values()) == pytest.approx(sum(o["total_ms"] for o in ops))
    # custom ops named the way hand-registered kernels name them; their inner events not counted twice
    by_name = {o["name"]: o for o in kernels}
    assert by_name["llama::custom_sdpa.out"]["calls"] % 3 == 0 and by_name["llama::custom_sdpa.out"]["calls"] > 0
    assert "inner_loop" not in by_name
    assert data["execute_ms"] > sum(o["total_ms"] for o in ops)


def test_without_etrecord_no_source_lines(exported):
    result = run_cli("profile", str(exported["pte"]), "--from-etdump", str(exported["etdump"]), "--top", "40")
    assert result.returncode == 0, result.stderr
    assert "model.py:" not in result.stdout and "pass --etrecord for source lines" in result.stdout
    assert "aten::embedding.out" in result.stdout  # names still come from the program


@pytest.fixture(scope="module")
def other_program(tmp_path_factory):
    """Another program with its ETRecord: the wrong partner for the nanoGPT export."""
    import copy

    import torch
    from executorch.devtools import generate_etrecord
    from executorch.exir import to_edge

    class Tiny(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x * 2 + 1)

    folder = tmp_path_factory.mktemp("other")
    edge = to_edge(torch.export.export(Tiny(), (torch.randn(2, 3),)))
    edge_copy = copy.deepcopy(edge)
    program = edge.to_executorch()
    etrecord = folder / "other.etrecord"
    generate_etrecord(str(etrecord), edge_copy, program)
    pte = folder / "other.pte"
    pte.write_bytes(program.buffer)
    etdump = folder / "other.etdp"
    etdump.write_bytes(_etdump_for(program.buffer, runs=1))
    return {"pte": pte, "etrecord": etrecord, "etdump": etdump}


def test_mismatched_files_are_refused(exported, other_program):
    pte, etdump = str(exported["pte"]), str(exported["etdump"])
    result = run_cli("profile", pte, "--from-etdump", etdump, "--etrecord", str(other_program["etrecord"]))
    _one_line_error(result, "does not match this program")
    result = run_cli("profile", pte, "--from-etdump", str(other_program["etdump"]))
    _one_line_error(result, "does not match this program")
    # and the matching pair of the other program works
    result = run_cli(
        "profile", str(other_program["pte"]), "--from-etdump", str(other_program["etdump"]),
        "--etrecord", str(other_program["etrecord"]),
    )
    assert result.returncode == 0, result.stderr
    assert "aten::relu.out" in result.stdout


def test_errors_are_one_line(exported, tmp_path):
    pte = str(exported["pte"])
    _one_line_error(run_cli("profile", pte, "--from-etdump", pte), "is not an ETDump")
    cut = tmp_path / "cut.etdp"
    cut.write_bytes(exported["etdump"].read_bytes()[:2000])
    _one_line_error(run_cli("profile", pte, "--from-etdump", str(cut)), "is truncated")
    _one_line_error(
        run_cli("profile", pte, "--from-etdump", str(exported["etdump"]), "--etrecord", pte), "cannot be read"
    )
    _one_line_error(run_cli("profile", pte), "needs --prompt")
    _one_line_error(run_cli("profile", pte, "--prompt", "hi", "--etrecord", str(tmp_path / "no")), "does not exist")
    _one_line_error(run_cli("profile", str(tmp_path / "no.pte"), "--prompt", "hi"), "does not exist")
