"""Stage 5: to_edge + lowering, with partitioners in the order the user listed backends.

``--plugins gpu,cpu`` gives the GPU backend the first pick of the graph and the CPU backend
what is left. The order comes from the user's list, never from plugin registration order.
"""

from __future__ import annotations

import collections
import logging
import operator
from collections import Counter
from contextlib import ExitStack
from typing import Any, Optional

import torch

from llmcore import upstream
from llmcore.errors import LlmcoreError, stage_errors
from llmcore.plugins import Provided, Registry
from llmcore.recipe import check_plugin_options
from llmcore.records import Backend

log = logging.getLogger(__name__)


def resolve_backends(names: list[str], backend_options: dict, registry: Registry) -> list[tuple[Provided, dict]]:
    """Look up each selected backend, in order, with its checked options."""
    if len(set(names)) != len(names):
        dup = [n for n, c in Counter(names).items() if c > 1]
        raise LlmcoreError(
            f"backend {dup[0]!r} is listed twice in --plugins.",
            stage="lower",
            fix="list each backend once.",
        )
    unknown_opts = set(backend_options) - set(names)
    if unknown_opts:
        name = sorted(unknown_opts)[0]
        raise LlmcoreError(
            f"backend options are given for {name!r}, which is not in --plugins.",
            stage="options",
            fix=f"add {name} to --plugins or drop its options.",
        )
    resolved = []
    for name in names:
        if name not in registry.names("backends") and name in registry.names("model_families"):
            raise LlmcoreError(
                f"{name!r} is a model family, not a backend.",
                stage="lower",
                fix=f"pass it as --model {name}; --plugins lists backends.",
            )
        provided = registry.get("backends", name, stage="lower")
        backend: Backend = provided.record
        opts = check_plugin_options(
            f"backend {name!r}", backend.options, backend_options.get(name, {}), provided.plugin.name
        )
        resolved.append((provided, opts))
    return resolved


# The patches of llmcore.upstream applied while lowering, entered in this order (so left in
# the reverse): the backends' own come after them.
LOWERING_PATCHES = (
    "lean_dependency_viewers",
    "legalize_in_place",
    "constant_inputs_listed_once",
    "type_hints_read_once",
    "forget_lowered_nodes",
)


def edge_compile_config(backends: list[Backend]):
    from executorch.exir import EdgeCompileConfig

    check = all(b.edge.check_ir_validity for b in backends) if backends else True
    skip_dim_order = any(b.edge.skip_dim_order for b in backends)
    return EdgeCompileConfig(_check_ir_validity=check, _skip_dim_order=skip_dim_order)


def lower(
    exported: torch.export.ExportedProgram,
    backends: list[tuple[Provided, dict]],
    constant_methods: dict[str, Any],
    repeated: bool = True,
    partitioners: Optional[list] = None,
):
    """Returns the EdgeProgramManager with every backend's delegates in place.

    With ``repeated``, a program of identical blocks (decoder layers) goes through
    ``to_edge`` two blocks at a time (:mod:`llmcore.pipeline.repeated`). ``partitioners``:
    partitioner objects to lower with in place of the backends' own (their edge settings and
    ``while_lowering`` still apply)."""
    from executorch.exir import to_edge_transform_and_lower

    if partitioners is None:
        partitioners = []
        for provided, opts in backends:
            backend: Backend = provided.record
            failed = f"backend {backend.name!r} could not create its partitioner"
            fix = "check the backend's options and its installation (--debug shows the traceback)."
            with stage_errors("lower", provided.plugin.name, failed, fix):
                partitioners.extend(backend.partitioners(opts))
        names = ", ".join(p.record.name for p, _ in backends) or "the portable runtime"
    else:
        partitioners = list(partitioners)
        names = ", ".join(type(p).__name__ for p in partitioners) or "the portable runtime"
    config = edge_compile_config([p.record for p, _ in backends])
    first_plugin = backends[0][0].plugin.name if backends else None
    fix = "try the backends one at a time to find the one that fails (--debug shows the traceback)."
    with stage_errors("lower", first_plugin, f"lowering to {names} failed", fix), ExitStack() as contexts:
        for patch in LOWERING_PATCHES:
            contexts.enter_context(upstream.applied(patch))
        for provided, opts in backends:
            if provided.record.while_lowering is not None:
                contexts.enter_context(provided.record.while_lowering(opts))
        upstream.warn_unknown_switch_names()  # the backends in use have registered theirs
        from llmcore.pipeline import repeated as repeated_blocks

        # on both paths, so that they lower the same program (see gather_block_nodes)
        repeated_blocks.gather_block_nodes(exported)
        if repeated:
            try:
                return repeated_blocks.lower_repeated(exported, partitioners, config, constant_methods)
            except repeated_blocks.NotRepeated as reason:
                log.info("lowering the whole graph: %s", reason)
        return to_edge_transform_and_lower(
            exported,
            partitioner=partitioners,
            compile_config=config,
            constant_methods=constant_methods,
        )


# What the patches of llmcore.upstream install while lowering follows: each is swapped in,
# and out, in llmcore/upstream.py, whose records say what it replaces and why.

# ---- partitioning memory (the ``lean_dependency_viewers`` patch) -----------------------------

# The partitioners that group supported nodes into delegates (torch.fx's
# CapabilityBasedPartitioner and ExecuTorch's GroupBasedPartitioner, which XNNPACK uses) first
# build a ``_DependencyViewer``: for every node, the set of all nodes downstream of it (and,
# in ExecuTorch's, upstream too). That is quadratic in the graph: for a 30-layer model it was
# the peak of the whole export. They only ever iterate over one node's downstream nodes, so
# the same answer can come from bitmasks (N^2 bits, a hundredth of the sets' memory; figures:
# docs/performance.md, "Measurements behind the code").
_VIEWER_MODULES = (
    "torch.fx.passes.infra.partitioner",
    "executorch.exir.backend.canonical_partitioners.group_partitioner",
)


class _NodeSet:
    """The nodes whose bits are set in ``mask``, in graph order (a read-only set view)."""

    __slots__ = ("_mask", "_nodes", "_index")

    def __init__(self, mask: int, nodes: list, index: dict):
        self._mask, self._nodes, self._index = mask, nodes, index

    def __iter__(self):
        mask, nodes = self._mask, self._nodes
        while mask:
            low = mask & -mask
            yield nodes[low.bit_length() - 1]
            mask ^= low

    def __contains__(self, node) -> bool:
        i = self._index.get(node)
        return i is not None and bool(self._mask >> i & 1)

    def __len__(self) -> int:
        return bin(self._mask).count("1")

    def __bool__(self) -> bool:
        return bool(self._mask)


class LeanDependencyViewer:
    """Drop-in for the partitioners' ``_DependencyViewer``: transitive downstream (and
    upstream) nodes of each node, kept as bitmasks over the graph's node order."""

    def __init__(self, graph_module) -> None:
        self._nodes = list(graph_module.graph.nodes)
        self._index = {node: i for i, node in enumerate(self._nodes)}
        self._down: dict = {}
        for node in reversed(self._nodes):
            mask = 0
            for user in node.users:
                j = self._index.get(user)
                if j is not None:
                    mask |= (1 << j) | self._down.get(user, 0)
            self._down[node] = mask
        self._up: dict | None = None
        self._partitions: dict = {}

    def downstreams_of(self, node) -> _NodeSet:
        return _NodeSet(self._down.get(node, 0), self._nodes, self._index)

    def partition_masks(self, partition) -> tuple[int, int]:
        """``(nodes, users outside it)`` of a partition as bitmasks, cached while it keeps its size."""
        key = id(partition)
        cached = self._partitions.get(key)
        if cached is not None and cached[0] == len(partition.nodes):
            return cached[1], cached[2]
        index = self._index
        nodes = users = 0
        for node in partition.nodes:
            nodes |= 1 << index[node]
            for user in node.users:
                users |= 1 << index[user]
        users &= ~nodes
        self._partitions[key] = (len(partition.nodes), nodes, users)
        return nodes, users

    def reaches(self, sources: int, targets: int) -> bool:
        """Whether a node downstream of any node in ``sources`` is in ``targets``."""
        nodes = self._nodes
        while sources:
            low = sources & -sources
            if self._down.get(nodes[low.bit_length() - 1], 0) & targets:
                return True
            sources ^= low
        return False

    def upstreams_of(self, node) -> _NodeSet:
        if self._up is None:
            self._up = {}
            for node_ in self._nodes:
                mask = 0
                for source in node_.all_input_nodes:
                    j = self._index.get(source)
                    if j is not None:
                        mask |= (1 << j) | self._up.get(source, 0)
                self._up[node_] = mask
        return _NodeSet(self._up.get(node, 0), self._nodes, self._index)


def _can_merge_partitions(self, p1, p2, partitions_by_id) -> bool:
    """ExecuTorch's ``GroupBasedPartitioner._can_merge_partitions`` on bitmasks.

    Two partitions can merge unless the merged one would form a cycle: a node outside it
    that uses one of its nodes and leads back into it. The original asks that twice (its
    own downstream scan, then torch.fx's ``validate_partition``, a breadth-first search
    over the graph: the same question), building node sets for every pair it tries. It
    tries each partition against every later one, so on a 30-layer model it took over a
    quarter of the lowering; with cached masks the same answers take well under a second.
    """
    viewer = self.dependency_viewer
    nodes_1, users_1 = viewer.partition_masks(partitions_by_id[p1])
    nodes_2, users_2 = viewer.partition_masks(partitions_by_id[p2])
    merged = nodes_1 | nodes_2
    return not viewer.reaches((users_1 | users_2) & ~merged, merged)


# ---- matching nodes to a partitioner's configs (``constant_inputs_listed_once``) -------------


def constant_input_names(exported) -> frozenset:
    """The graph inputs that are parameters, buffers or lifted constants: the names for which
    ``torch._export.utils`` ``is_param``, ``is_buffer`` or ``is_lifted_tensor_constant`` holds."""
    from torch.export.graph_signature import InputKind, TensorArgument

    kinds = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    return frozenset(
        s.arg.name for s in exported.graph_signature.input_specs
        if s.kind in kinds and isinstance(s.arg, TensorArgument) and isinstance(s.target, str)
    )


# ---- cutting delegates out of the graph (``legalize_in_place``) -----------------------------

# After cutting each partition out of the graph, ExecuTorch's ``create_submodule_from_nodes``
# re-sorts the whole graph with torch.fx's ``legalize_graph``, which copies every node into a
# new graph and recompiles the module's Python code: once per delegate, over the whole
# program: quadratic in the layer count. The order is what
# matters; :func:`legalize_order` computes the same one and the nodes are moved into it in
# place (each node's users listed in it, as the copy lists them: the next sort reads them),
# and the code is generated once, when lowering ends.

# torch.fx's legalize_graph puts these first among the nodes that become ready (runtime
# assertions before data-dependent operators); the same list, for the same order.
_PRIORITIZED_OPS = (
    operator.add, operator.mul, operator.sub, operator.floordiv, operator.truediv, operator.mod,
    operator.le, operator.lt, operator.ge, operator.gt, operator.eq, operator.ne,
)
_PRIORITIZED_ATEN = (
    "sym_constrain_range.default", "sym_constrain_range_for_size.default", "_assert_async.msg",
    "scalar_tensor.default", "_assert_scalar.default",
)


def _aten(name: str):
    packet, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, packet), overload)


def legalize_order(graph) -> list:
    """The nodes of ``graph`` in the order torch.fx's ``legalize_graph`` gives them: Kahn's
    algorithm from the graph's order, nodes that become ready queued last, except the
    prioritized operators, queued first."""
    prioritized = set(_PRIORITIZED_OPS) | {_aten(name) for name in _PRIORITIZED_ATEN}
    nodes = list(graph.nodes)
    indeg = dict.fromkeys(nodes, 0)
    for node in nodes:
        for user in node.users:
            indeg[user] += 1
    queue = collections.deque(node for node in nodes if indeg[node] == 0)
    order = []
    while queue:
        cur = queue.popleft()
        order.append(cur)
        for user in cur.users:
            indeg[user] -= 1
            if indeg[user] == 0:
                if user.op == "call_function" and user.target in prioritized:
                    queue.appendleft(user)
                else:
                    queue.append(user)
    if len(order) < len(nodes):
        raise RuntimeError(f"Input graph has cycles, unable to add {[node for node in indeg if indeg[node] != 0]}")
    return order
