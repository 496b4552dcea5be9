"""Lowering to XNNPACK without the work that cannot change the program.

An LLM's graph is N copies of one decoder layer, so ExecuTorch spends most of an export
redoing the same generic work N times. Two parts of it are avoidable, and this module
avoids them while leaving the program byte for byte what ExecuTorch would produce
(``tests/test_lowering.py`` compares every delegate's bytes and named data):

**Decomposition passes.** ``to_edge_transform_and_lower`` keeps the ops a partitioner
asks for (``linear``, ...) out of the decompositions. When the partitioner also gives a
filter (XNNPACK does: it declines some linears, e.g. with a computed weight), ExecuTorch
takes its slow path: three whole-graph retraces instead of one, so that the declined
nodes can be decomposed after all. When the filter accepts every such node in the graph
(it does for every model llmcore exports), the slow path keeps exactly the ops the fast
one keeps, so :func:`ops_to_not_decompose` checks that and, if so, gives no filter: the
fast path runs. Anything the filter declines keeps the slow path.

**XNNPACK's preprocess passes.** Each delegate goes through 17 graph passes, each a
full fake-tensor retrace (~0.1-0.2 s each on the 2-core build machine), before it is
serialized; for a decoder layer all but two of them change nothing. The passes depend on
the partition's structure (operators, wiring, shapes, dtypes), not on its weights, so
:class:`RememberedPassManager` runs every pass on the first partition of each structure,
notes which ones changed it, and runs only those on the partitions that repeat it. A pass
counts as changing a partition when it changes the graph, any node's metadata (other than
the traced values and provenance that passes rewrite anyway), or any constant tensor.
"""

from __future__ import annotations

import importlib
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

logger = logging.getLogger(__name__)

# ---- decompositions ---------------------------------------------------------------------


def ops_to_not_decompose(ep, ops: list, keep: Callable[[torch.fx.Node], bool] | None):
    """``(ops, keep)`` as the partitioner would answer, with ``keep`` dropped when it keeps
    every node it is asked about in this ATen program (see the module docstring)."""
    if keep is None or _is_edge_program(ep):
        return ops, keep
    wanted = set(ops)
    for node in ep.graph.nodes:
        if node.op == "call_function" and node.target in wanted and not keep(node):
            return ops, keep
    try:
        from executorch.exir.program._program import _remove_invalid_ops_for_not_decompose
    except ImportError:  # another ExecuTorch: keep its own (slow but right) path
        return ops, keep

    # The slow path drops ops that cannot be preserved (mutable, aliasing) before it
    # preserves the rest; the fast path must preserve the same set.
    return _remove_invalid_ops_for_not_decompose(list(ops)), None


def _is_edge_program(ep) -> bool:
    """After lowering, ExecuTorch asks again on the edge program; there the filter must stay."""
    from executorch.exir.dialects.edge._ops import EdgeOpOverload

    return any(node.op == "call_function" and isinstance(node.target, EdgeOpOverload) for node in ep.graph.nodes)


# ---- XNNPACK's preprocess passes ---------------------------------------------------------

# Metadata that every retrace rewrites (traced values, provenance) or that cannot affect
# how XNNPACK serializes a node.
_VOLATILE_META = frozenset(
    {
        "val",
        "tensor_meta",
        "stack_trace",
        "nn_module_stack",
        "source_fn_stack",
        "from_node",
        "seq_nr",
        "original_aten",
        "torch_fn",
        "debug_handle",
        "custom",
        "unbacked_bindings",
    }
)


def _value_shape(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(str(s) for s in value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_value_shape(v) for v in value)
    return str(value) if value is not None else None


def _by_position(index: dict) -> Callable[[Any], Any]:
    """Node arguments with each node replaced by its position: comparable across graphs."""

    def arg(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return ("node", index[a])
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, arg(v)) for k, v in a.items())
        return repr(a)

    return arg


def partition_structure(ep) -> tuple:
    """What XNNPACK's passes see of a partition, without its weights or node names."""
    graph = ep.graph_module.graph
    index = {node: i for i, node in enumerate(graph.nodes)}
    signature = ep.graph_signature
    kinds = {
        **{name: "parameter" for name in signature.inputs_to_parameters},
        **{name: "buffer" for name in signature.inputs_to_buffers},
        **{name: "constant" for name in signature.inputs_to_lifted_tensor_constants},
    }

    arg = _by_position(index)
    rows = []
    for node in graph.nodes:
        kind = kinds.get(node.name, "input") if node.op == "placeholder" else str(node.target)
        rows.append((node.op, kind, arg(node.args), arg(node.kwargs), _value_shape(node.meta.get("val"))))
    return tuple(rows)


def _state(ep) -> tuple:
    """The graph with its metadata, and the identity of every constant: what a pass may change."""
    graph = []
    arg = _by_position({node: i for i, node in enumerate(ep.graph_module.graph.nodes)})
    for node in ep.graph_module.graph.nodes:
        meta = tuple(sorted((k, repr(v)) for k, v in node.meta.items() if k not in _VOLATILE_META))
        graph.append((node.op, str(node.target), arg(node.args), arg(node.kwargs), meta))
    constants = tuple(
        (name, id(t), t.data_ptr() if isinstance(t, torch.Tensor) else None)
        for store in (ep.state_dict, ep.constants)
        for name, t in sorted(store.items())
    )
    return tuple(graph), constants


def remembered_pass_manager(base: type) -> type:
    """A drop-in for XNNPACK's ``XNNPACKPassManager`` (class ``base``) that skips the passes
    which changed nothing in an earlier partition of the same structure."""

    class RememberedPassManager(base):
        # structure -> the passes that changed the first partition of that structure
        needed: dict = {}
        partitions = 0
        passes_skipped = 0

        def transform(self):
            from executorch.backends.xnnpack._passes.xnnpack_pass import XNNPACKPass
            from executorch.exir.program._program import _transform

            cls = type(self)
            cls.partitions += 1
            ep = self.exported_program
            structure = partition_structure(ep)
            known = cls.needed.get(structure)
            if known is not None:
                cls.passes_skipped += len(self.passes) - len(known)
            changed = []
            for pass_ in self.passes:
                if known is not None and pass_ not in known:
                    continue
                before = _state(ep) if known is None else None
                ep = _transform(ep, pass_(ep) if issubclass(pass_, XNNPACKPass) else pass_())
                if known is None and _state(ep) != before:
                    changed.append(pass_)
            if known is None:
                cls.needed[structure] = frozenset(changed)
            return ep

    RememberedPassManager.__name__ = RememberedPassManager.__qualname__ = "RememberedPassManager"
    return RememberedPassManager


@contextmanager
def remembered_passes() -> Iterator[type]:
    """While lowering, XNNPACK's preprocess uses a fresh :func:`remembered_pass_manager`."""
    module = importlib.import_module("executorch.backends.xnnpack.xnnpack_preprocess")
    original = module.XNNPACKPassManager
    manager = remembered_pass_manager(original)
    module.XNNPACKPassManager = manager
    try:
        yield manager
    finally:
        module.XNNPACKPassManager = original
        if manager.partitions:
            logger.info(
                "xnnpack: %d partitions in %d structures; %d preprocess passes skipped as no-ops on an "
                "identical partition",
                manager.partitions,
                len(manager.needed),
                manager.passes_skipped,
            )
