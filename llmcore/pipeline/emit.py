"""Stage 6: post-passes, then to_executorch: the program's bytes (and an ETRecord)."""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any, Optional

from llmcore import upstream
from llmcore.errors import stage_errors
from llmcore.plugins import Provided, Registry
from llmcore.recipe import meant_for
from llmcore.records import PostPass
from llmcore.runtime.libraries import graph_operators, operator_name


def select_post_passes(registry: Registry, backends: list[str]) -> list[Provided]:
    """The post-passes of an export of ``backends``, in the order they run (the plan's)."""
    chosen = [p for p in registry.all("post_passes") if meant_for(p.record.backends, backends)]
    return sorted(chosen, key=lambda p: (p.record.order, p.record.name))


# The patches of llmcore.upstream that post-passes and to_executorch apply.
EMIT_PATCHES = ("recorded_delegate_outputs", "quant_fusion_only_where_quantized", "constants_emitted_in_place")


def called_operators(edge) -> set[str]:
    """The names (``"aten::mm"``) of the operators the program's graph calls outside its
    delegates."""
    return graph_operators(edge.exported_program())


def apply_post_passes(edge, passes: list[Provided]):
    """Each pass re-traces the lowered program; delegate calls answer from their records
    (the ``recorded_delegate_outputs`` patch) instead of running their graphs again. A pass that
    names the operators it rewrites is skipped where the graph calls none of them."""
    for provided in passes:
        post: PostPass = provided.record
        if post.rewrites and not called_operators(edge) & set(post.rewrites):
            continue
        fix = "report it to the plugin's authors (--debug shows the traceback)."
        with stage_errors("post-passes", provided.plugin.name, f"post-pass {post.name!r} failed", fix), \
                upstream.applied("recorded_delegate_outputs"):
            edge = edge.transform([post.create()])
    return edge


def to_executorch(edge, etrecord_path: Optional[str] = None, edge_copy: Any = None, in_place_constants: bool = False):
    """Serialise the edge program; writes an ETRecord when asked. ``in_place_constants``: the
    program's buffers are the large constants' own memory, not copies (the
    ``constants_emitted_in_place`` patch), for a caller that writes the program before
    anything changes a weight; an export that writes an ETRecord keeps upstream's copies
    (its graph and program are kept to be looked at)."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    config = ExecutorchBackendConfig(
        extract_delegate_segments=True,
        do_quant_fusion_and_const_prop=True,
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
        sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
        # index_put on a mutable buffer (a plain-PyTorch KV cache) becomes an in-place
        # write instead of a functional copy of the whole buffer.
        run_reinplace_pass=True,
    )
    fix = "run with --debug for the traceback; a post-pass or backend left the graph in a state ExecuTorch cannot plan."
    in_place = in_place_constants and not etrecord_path
    with stage_errors("emit", None, "to_executorch failed", fix), upstream.applied("recorded_delegate_outputs"), \
            upstream.applied("quant_fusion_only_where_quantized"), \
            upstream.applied("constants_emitted_in_place") if in_place else nullcontext():
        program = edge.to_executorch(config)
    if etrecord_path and edge_copy is not None:
        from executorch.devtools import generate_etrecord

        from llmcore.pipeline.write import _write_error

        try:
            generate_etrecord(etrecord_path, edge_copy, program)
        except OSError as exc:  # a full disk, a file-size limit: the bundle discards the file
            raise _write_error(etrecord_path, exc) from None
    return program


def copy_for_etrecord(edge):
    """ETRecord wants the edge program as it was before to_executorch mutated it."""
    return copy.deepcopy(edge)


# Operator namespaces whose quantize / dequantize operators every pattern of ExecuTorch's
# QuantFusionPass starts from (tests/test_post_passes.py checks its patterns): where the
# graph outside the delegates calls none, the ``quant_fusion_only_where_quantized`` patch
# skips the pass.
QUANTIZE_NAMESPACES = ("quantized_decomposed", "torchao")


def is_quantize_operator(node) -> bool:
    """Whether ``node`` calls a quantize or dequantize operator (``quantized_decomposed::
    dequantize_per_tensor``, ``torchao::dequantize_affine``, ...)."""
    name = operator_name(node.target) if node.op == "call_function" else None
    if name is None:
        return False
    namespace, _, op = name.partition("::")
    return namespace in QUANTIZE_NAMESPACES and "quantize" in op
