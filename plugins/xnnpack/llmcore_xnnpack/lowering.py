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
full fake-tensor retrace, before it is serialized; for a decoder layer all but two of
them change nothing. Two of them look for a
pattern (bilinear upsampling, decomposed attention) that cannot be there when the partition
lacks its key operator, six others rewrite only nodes of a few operators (batch norm,
concatenation, ...): they are skipped on partitions without them (:func:`could_match`). The
passes depend on the partition's structure (operators, wiring, shapes, dtypes), not on its
weights, so :class:`RememberedPassManager` runs every pass on the first partition of each
structure and remembers what came out. A partition that repeats the structure then gets that
graph, transplanted (:class:`PassedGraph`): the same nodes, its own weights and debug
handles. Where the passes changed a constant tensor (they then derived it from the first
partition's weights), or a node carries a debug handle the partition cannot map, the
partition runs the passes that changed the first one instead. A pass counts as changing a
partition when it changes the graph, any node's metadata (other than the traced values
and provenance that passes rewrite anyway), or any constant tensor.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from llmcore import upstream

logger = logging.getLogger(__name__)

# ---- decompositions ---------------------------------------------------------------------


def ops_to_not_decompose(ep, ops: list, keep: Callable[[torch.fx.Node], bool] | None):
    """``(ops, keep)`` as the partitioner would answer, with ``keep`` dropped when it keeps
    every node it is asked about in this ATen program (see the module docstring; the
    ``ops_kept_without_filter`` patch of :mod:`llmcore.upstream`)."""
    if keep is None or not upstream.active("ops_kept_without_filter") or _is_edge_program(ep):
        return ops, keep
    wanted = set(ops)
    for node in ep.graph.nodes:
        if node.op == "call_function" and node.target in wanted and not keep(node):
            return ops, keep
    from executorch.exir.program._program import _remove_invalid_ops_for_not_decompose

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


@dataclasses.dataclass
class Before:
    """What a partition was before the passes: placeholder names and every node's debug
    handle in graph order, and its constants' identities (:func:`_state`)."""

    placeholders: list
    handles: list
    constants: tuple

    @classmethod
    def of(cls, ep) -> "Before":
        nodes = list(ep.graph.nodes)
        return cls([n.name for n in nodes if n.op == "placeholder"], [n.meta.get("debug_handle") for n in nodes],
                   _state(ep)[1])


class PassedGraph:
    """The first partition of a structure as XNNPACK's passes left it, to be given to the
    partitions that repeat the structure with their own weights and debug handles.

    ``before`` is that partition before the passes: its placeholders and its nodes' debug
    handles, in graph order, are what a repeating partition's are matched against (same
    structure: same order). The passes keep every placeholder (a graph whose passes added
    or rewrote a constant is not kept: see :meth:`remember`).
    """

    def __init__(self, before: "Before", after):
        self.placeholders, self.handles = before.placeholders, before.handles
        self.after = after
        # the passed graph's handles, kept: each transplant rewrites the nodes' metadata
        self.after_handles = [(n, n.meta.get("debug_handle")) for n in after.graph.nodes]

    @classmethod
    def remember(cls, before: "Before", after) -> "PassedGraph | None":
        placeholders = [n.name for n in after.graph.nodes if n.op == "placeholder"]
        if _state(after)[1] != before.constants or not set(placeholders) <= set(before.placeholders):
            return None
        return cls(before, after)

    def transplant(self, ep):
        """This graph with ``ep``'s weights and debug handles, or None when ``ep``'s handles
        do not map one to one onto the first partition's."""
        from torch.export import ExportedProgram
        from torch.export.graph_signature import ExportGraphSignature

        handle_of: dict = {}
        for mine, theirs in zip(self.handles, (n.meta.get("debug_handle") for n in ep.graph.nodes)):
            if mine is None:
                continue
            if handle_of.setdefault(mine, theirs) != theirs:
                return None
        names = dict(zip(self.placeholders, (n.name for n in ep.graph.nodes if n.op == "placeholder")))
        specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
        input_specs = []
        for spec in self.after.graph_signature.input_specs:
            own = specs[names[spec.arg.name]]
            if own.kind != spec.kind:
                return None
            input_specs.append(dataclasses.replace(spec, target=own.target, persistent=own.persistent))
        for node, handle in self.after_handles:
            if handle is not None and handle not in handle_of:
                return None
        for node, handle in self.after_handles:
            if handle is None:
                node.meta.pop("debug_handle", None)
            else:
                node.meta["debug_handle"] = handle_of[handle]
        after = self.after
        return ExportedProgram(
            root=after.graph_module,
            graph=after.graph,
            graph_signature=ExportGraphSignature(
                input_specs=input_specs, output_specs=list(after.graph_signature.output_specs)
            ),
            state_dict=ep.state_dict,
            range_constraints=ep.range_constraints,
            module_call_graph=after.module_call_graph,
            example_inputs=None,
            constants=ep.constants,
            verifiers=after.verifiers,
        )


# Passes that only replace one of ExecuTorch's patterns, by class name, and an operator that
# every one of their patterns contains (``test_lowering`` checks that against ExecuTorch's own
# pattern graphs). A partition without that operator holds no match, and the pass would only
# retrace it; its first call also builds the pattern graphs with ``torch.export``, once per
# process, a cost of its own (docs/performance.md, "Measurements behind the code").
PATTERN_PASS_OPERATORS = {
    "ConvertToUpsampleBilinear2d": "aten.upsample_bilinear2d.vec",
    "ConvertToSDPAPass": "aten._softmax.default",
}


# Passes that rewrite only nodes of some operators (and then retrace the whole partition,
# whether they rewrote any or not), by class name: those operators. On a partition without
# them the pass changes nothing and costs a retrace, for each partition structure
# (docs/performance.md, "Measurements behind the code"). ``test_lowering`` checks the
# names against the passes (their operator lists and source); its byte-for-byte comparison
# with every pass run shows the skips change nothing.
NODE_PASS_OPERATORS = {
    "FuseBatchNormPass": ("aten.native_batch_norm.default", "aten._native_batch_norm_legit_no_training.default"),
    "DecomposeBatchNorm": ("aten.native_batch_norm.default", "aten._native_batch_norm_legit_no_training.default"),
    "FuseActivationPass": ("aten.relu.default", "aten.hardtanh.default"),
    "DecomposeConcatenate": ("aten.cat.default",),
    "Conv1dUnsqueezePass": ("aten.convolution.default",),
    "PReLUReshapePass": ("aten._prelu_kernel.default",),
    # [add]mm and bmm into linear: on a partition whose linears were kept whole, none is left
    "ConvertToLinearPass": ("aten.mm.default", "aten.addmm.default", "aten.bmm.default"),
    # pairs of copies that undo each other; a decoder layer has no copy at all
    "RemoveRedundantCopyPass": ("aten._to_copy.default",),
}

# Passes that only copy one metadata key from node to node (and then retrace), by class
# name: that key. A partition where no node carries it is left as it was.
META_PASS_KEYS = {
    "PropagateCustomMetaPass": "custom",  # user annotations, onto the (de)quantize nodes
}

# Every skippable pass, by class name: the operators one of which a partition must hold.
_NEEDED_OPERATORS = {**{name: (op,) for name, op in PATTERN_PASS_OPERATORS.items()}, **NODE_PASS_OPERATORS}


def could_match(pass_: type, ep) -> bool:
    """False when ``pass_`` rewrites a pattern, nodes of operators or a metadata key that
    ``ep`` lacks (a no-op there)."""
    key = META_PASS_KEYS.get(pass_.__name__)
    if key is not None:
        return any(key in n.meta for n in ep.graph.nodes)
    needed = _NEEDED_OPERATORS.get(pass_.__name__)
    if needed is None:
        return True
    return any(n.op == "call_function" and getattr(n.target, "__name__", None) in needed for n in ep.graph.nodes)


def remembered_pass_manager(base: type) -> type:
    """A drop-in for XNNPACK's ``XNNPACKPassManager`` (class ``base``) that gives a partition
    repeating an earlier one's structure that partition's passed graph (:class:`PassedGraph`)
    or, failing that, runs only the passes which changed it."""

    class RememberedPassManager(base):
        # structure -> the passes that changed the first partition of that structure
        needed: dict = {}
        # structure -> that partition after the passes (None: it cannot be transplanted)
        passed: dict = {}
        partitions = 0
        passes_skipped = 0
        transplanted = 0

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
                template = cls.passed.get(structure)
                result = template.transplant(ep) if template is not None else None
                if result is not None:
                    cls.transplanted += 1
                    return result
            first = Before.of(ep) if known is None else None
            changed = []
            for pass_ in self.passes:
                if known is not None and pass_ not in known:
                    continue
                if not could_match(pass_, ep):
                    cls.passes_skipped += 1
                    continue
                before = _state(ep) if known is None else None
                ep = _transform(ep, pass_(ep) if issubclass(pass_, XNNPACKPass) else pass_())
                if known is None and _state(ep) != before:
                    changed.append(pass_)
            if known is None:
                cls.needed[structure] = frozenset(changed)
                cls.passed[structure] = PassedGraph.remember(first, ep)
            return ep

    RememberedPassManager.__name__ = RememberedPassManager.__qualname__ = "RememberedPassManager"
    return RememberedPassManager


_PREPROCESS_MANAGER = "executorch.backends.xnnpack.xnnpack_preprocess:XNNPACKPassManager"


@contextmanager
def remembered_passes() -> Iterator[type]:
    """While lowering, XNNPACK's preprocess uses a fresh :func:`remembered_pass_manager`
    (the ``remembered_passes`` patch)."""
    manager = remembered_pass_manager(upstream.resolve(_PREPROCESS_MANAGER))
    try:
        with upstream.replaced((_PREPROCESS_MANAGER, manager)):
            yield manager
    finally:
        if manager.partitions:
            logger.info(
                "xnnpack: %d partitions in %d structures; %d preprocess passes skipped (no-ops on an "
                "identical partition, or patterns a partition lacks the operators of); %d partitions "
                "given the passed graph of the first of their structure",
                manager.partitions,
                len(manager.needed),
                manager.passes_skipped,
                manager.transplanted,
            )


# ---- finding linears' source partitions ----------------------------------------------------

_GEMM_CONFIGS = "executorch.backends.xnnpack.partition.config.gemm_configs"
_FIND_SOURCES = f"{_GEMM_CONFIGS}:get_source_partitions"
_MATCHED_NODES = ("executorch.exir.backend.canonical_partitioners.config_partitioner:"
                  "ConfigerationBasedPartitioner.get_matched_nodes_from_configs")


@contextmanager
def source_partitions_found_once() -> Iterator[None]:
    """While XNNPACK's partitioner matches one program's nodes, its GEMM configs find the
    graph's linear source partitions once, not once per GEMM node they are asked about (the
    ``source_partitions_found_once`` patch). Matching does not change the graph, so within
    one matching the answer is the same; the cache lives only that long."""
    find, match = upstream.resolve(_FIND_SOURCES), upstream.resolve(_MATCHED_NODES)
    found: dict | None = None  # (graph, wanted sources) -> partitions, while one program is matched

    def find_once(graph, wanted_sources, filter_fn=None):
        if found is None or filter_fn is not None:
            return find(graph, wanted_sources, filter_fn)
        key = (id(graph), tuple(wanted_sources))
        if key not in found:
            found[key] = find(graph, wanted_sources)
        return found[key]

    def matched_nodes(self, ep):
        nonlocal found
        found = {}
        try:
            return match(self, ep)
        finally:
            found = None

    with upstream.replaced((_FIND_SOURCES, find_once), (_MATCHED_NODES, matched_nodes)):
        yield


@contextmanager
def while_lowering() -> Iterator[None]:
    """Everything this module changes about XNNPACK's lowering, for the length of one."""
    with upstream.applied("remembered_passes"), upstream.applied("source_partitions_found_once"):
        yield


# ---- the patches, as llmcore.upstream lists them --------------------------------------------

_EDGE_MANAGER = "executorch.exir.program._program:_gen_edge_manager_for_partitioners"

PATCHES = tuple(
    upstream.register(patch)
    for patch in (
        upstream.Patch(
            name="ops_kept_without_filter",
            replaces=(),
            relies_on={
                _EDGE_MANAGER: (
                    "1165268e5782bf8f",  # 1.4.1
                    "14a2b38bd338a215",  # 1.5.1: adds pre-decomposition transforms and a skipped no-op retrace
                ),
                "executorch.exir.program._program:_remove_invalid_ops_for_not_decompose": ("3e17892fc8dbf7d8",),
            },
            requires=(upstream.EXECUTORCH,),
            why="XNNPACK's partitioner gives a filter with the operators it keeps out of the "
                "decompositions, which sends to_edge down its slow path (three whole-graph retraces "
                "instead of one); where the filter accepts every such node, both paths keep the same "
                "operators, so no filter is given (ops_to_not_decompose).",
            module=__name__,
        ),
        upstream.Patch(
            name="remembered_passes",
            replaces=(_PREPROCESS_MANAGER,),
            relies_on={
                "executorch.backends.xnnpack._passes:XNNPACKPassManager": ("7fcec85f18a3016d",),
                "executorch.backends.xnnpack.xnnpack_preprocess:XnnpackBackend.preprocess": ("62f7dc915f1ef40c",),
                "executorch.exir.program._program:_transform": ("9359d02c126f183c",),
            },
            requires=(upstream.EXECUTORCH,),
            why="Each delegate goes through XNNPACK's 17 preprocess passes, each a whole retrace, "
                "and all but two change nothing on a decoder layer; passes that cannot match a "
                "partition are skipped, and a partition repeating an earlier one's structure gets that "
                "one's passed graph with its own weights (RememberedPassManager).",
            apply=remembered_passes,
            module=__name__,
        ),
        upstream.Patch(
            name="source_partitions_found_once",
            replaces=(_FIND_SOURCES, _MATCHED_NODES),
            relies_on={
                "torch.fx.passes.utils.source_matcher_utils:get_source_partitions": ("2efa189daa77e24f",),
                f"{_GEMM_CONFIGS}:GEMMConfig.get_deps": ("d1472ef54e52bebd",),
                _MATCHED_NODES: ("0a4b7b5eef4b1a06",),
            },
            requires=(upstream.TORCH, upstream.EXECUTORCH),
            why="XNNPACK's GEMM configs walk the whole graph for its linear source partitions once "
                "per candidate node, work that grows with the square of the layer count; they are "
                "found once per matching.",
            apply=source_partitions_found_once,
            module=__name__,
        ),
    )
)


def upstream_patches() -> tuple:
    """The patches :func:`while_lowering` (and :func:`ops_to_not_decompose`) apply: the
    backend's ``upstream_patches``, whose ranges an export checks before it loads a model."""
    return PATCHES
