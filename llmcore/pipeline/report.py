"""The export report: delegation summary, per-operator table, stages, parity.

Printed after every export and saved as ``<output>.report.json`` next to the `.pte`.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import Any


def delegation_report(edge) -> dict[str, Any]:
    """What got delegated, from ExecuTorch's ``get_delegation_info``, plus a per-backend view."""
    from executorch.devtools.backend_debug import get_delegation_info

    graph_module = edge.exported_program().graph_module
    info = get_delegation_info(graph_module)
    frame = info.get_operator_delegation_dataframe()
    rows = [
        {
            "op_type": str(r["op_type"]),
            "delegated": int(r["occurrences_in_delegated_graphs"]),
            "not_delegated": int(r["occurrences_in_non_delegated_graphs"]),
        }
        for _, r in frame.iterrows()
        if r["op_type"] != "Total"
    ]
    return {
        "delegated_subgraphs": int(info.num_delegated_subgraphs),
        "delegated_nodes": int(info.num_delegated_nodes),
        "non_delegated_nodes": int(info.num_non_delegated_nodes),
        "operators": rows,
        "by_backend": ops_by_backend(graph_module),
    }


def ops_by_backend(graph_module) -> dict[str, dict[str, Any]]:
    """For each backend id: how many delegates it got and which operators they hold."""
    result: dict[str, dict[str, Any]] = defaultdict(lambda: {"delegates": 0, "operators": Counter()})
    for node in graph_module.graph.nodes:
        if node.op != "get_attr":
            continue
        lowered = getattr(graph_module, str(node.target), None)
        backend_id = getattr(lowered, "backend_id", None)
        if backend_id is None:
            continue
        entry = result[backend_id]
        entry["delegates"] += 1
        original = getattr(lowered, "original_module", None)
        if original is None:
            continue
        for inner in original.graph.nodes:
            if inner.op == "call_function":
                entry["operators"][_op_name(inner.target)] += 1
    return {
        backend: {"delegates": e["delegates"], "operators": dict(sorted(e["operators"].items()))}
        for backend, e in result.items()
    }


def _op_name(target: Any) -> str:
    name = getattr(target, "__name__", None) or str(target)
    return name.replace(".", "_")


def format_delegation(delegation: dict[str, Any]) -> str:
    from tabulate import tabulate

    lines = [
        f"Total delegated subgraphs: {delegation['delegated_subgraphs']}",
        f"Number of delegated nodes: {delegation['delegated_nodes']}",
        f"Number of non-delegated nodes: {delegation['non_delegated_nodes']}",
    ]
    for backend, entry in delegation["by_backend"].items():
        ops = sum(entry["operators"].values())
        lines.append(f"  {backend}: {entry['delegates']} delegate(s), {ops} operator(s)")
    rows = [[r["op_type"], r["delegated"], r["not_delegated"]] for r in delegation["operators"]]
    rows.append(["Total", delegation["delegated_nodes"], delegation["non_delegated_nodes"]])
    table = tabulate(rows, headers=["op_type", "# in delegated graphs", "# in non-delegated graphs"], tablefmt="simple")
    return "\n".join(lines) + "\n\n" + table


def format_summary(report: dict[str, Any]) -> str:
    parity = report["parity"]
    files = report["outputs"]
    total = sum(s["wall_s"] for s in report["stages"])
    peak = max((s["peak_rss_mib"] for s in report["stages"]), default=0.0)
    wrote = f"wrote {files['pte']} ({files['pte_bytes'] / 2**20:.2f} MiB) in {total:.1f}s, peak RSS {peak:.0f} MiB\n"
    cache = report.get("model", {}).get("kv_cache")
    if cache:
        wrote += (f"KV cache: {cache['dtype']}, {cache['bytes'] / 2**20:.2f} MiB for {report['model']['max_seq_len']} "
                  f"positions ({cache['layers']} layers)\n")
    if "skipped" in parity:
        return wrote + f"parity vs {parity['reference']}: skipped ({parity['skipped']})"
    ties = parity.get("near_ties") or 0
    tie_note = (
        f"; {ties} of the disagreeing calls a near tie, the program's top two {parity['near_tie_gap']:.3g} apart"
        if ties else ""
    )
    widest = max(parity.get("disagreements") or [], key=lambda d: d["reference_margin"], default=None)
    if widest is not None:  # how sure the reference was where the program chose otherwise
        tie_note += (f"; where they differ the reference ranks the program's top-1 at most "
                     f"{widest['reference_margin']:.3g} below its own (that call's max |logit diff| "
                     f"{widest['max_abs_diff']:.3g})")
    return wrote + (
        f"parity vs {parity['reference']}: max |logit diff| {parity['max_abs_diff']:.3g}, "
        f"top-1 agreement {parity['top1_agreement']:.0%} (lengths {parity['lengths']}{tie_note})"
    )


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=False, default=str) + "\n"
