"""Lowering's memory: the partitioners' dependency sets, kept as bitmasks, give the same answers."""

from __future__ import annotations

import pytest
import torch

from llmcore import upstream
from llmcore.pipeline.lower import LeanDependencyViewer


class Branchy(torch.nn.Module):
    """Shared inputs, parallel branches and a join: every kind of reachability."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        h = torch.relu(self.a(x))
        g = torch.sigmoid(self.b(x)) * y
        return h + g, (h * 2).sum(), y - 1


def _graph():
    return torch.export.export(Branchy(), (torch.randn(2, 8), torch.randn(2, 8))).graph_module


def test_lean_viewer_agrees_with_torch_and_executorch():
    from torch.fx.passes.infra.partitioner import _DependencyViewer as TorchViewer

    group = pytest.importorskip("executorch.exir.backend.canonical_partitioners.group_partitioner")
    gm = _graph()
    lean, torch_viewer, et_viewer = LeanDependencyViewer(gm), TorchViewer(gm), group._DependencyViewer(gm)
    nodes = list(gm.graph.nodes)
    for node in nodes:
        down = lean.downstreams_of(node)
        assert set(down) == torch_viewer.downstreams_of(node) == et_viewer.downstreams_of(node)
        assert set(lean.upstreams_of(node)) == et_viewer.upstreams_of(node)
        assert len(down) == len(set(down)) and bool(down) == bool(set(down))
        assert all((other in down) == (other in torch_viewer.downstreams_of(node)) for other in nodes)


def test_the_viewers_are_swapped_only_while_lowering():
    from torch.fx.passes.infra import partitioner

    original = partitioner._DependencyViewer
    with upstream.applied("lean_dependency_viewers"):
        assert partitioner._DependencyViewer is LeanDependencyViewer
    assert partitioner._DependencyViewer is original


def test_lowering_builds_only_lean_viewers(monkeypatch):
    """The swap patches private names of torch and ExecuTorch: if an upgrade renames them, or
    a partitioner gets its viewer some other way, lowering would silently build the quadratic
    viewers again. A small XNNPACK export through ``lower.lower`` must construct the lean viewer
    from both partitioner modules, and never the originals."""
    import importlib
    import sys

    from llmcore.pipeline import lower
    from llmcore.plugins import PluginInfo, Provided
    from llmcore.records import Backend

    xnnpack = pytest.importorskip("executorch.backends.xnnpack.partition.xnnpack_partitioner")
    callers: list[str] = []
    originals: list[str] = []
    lean_init = LeanDependencyViewer.__init__

    def counting_lean(self, graph_module):
        callers.append(sys._getframe(1).f_globals["__name__"])
        for name in lower._VIEWER_MODULES:  # while lowering, every partitioner module has the lean one
            assert importlib.import_module(name)._DependencyViewer is LeanDependencyViewer
        lean_init(self, graph_module)

    monkeypatch.setattr(LeanDependencyViewer, "__init__", counting_lean)
    for name in lower._VIEWER_MODULES:
        original = importlib.import_module(name)._DependencyViewer
        monkeypatch.setattr(original, "__init__", lambda self, gm, _name=name: originals.append(_name))

    backend = Backend(name="cpu", description="XNNPACK", partitioners=lambda o: [xnnpack.XnnpackPartitioner()])
    exported = torch.export.export(Branchy(), (torch.randn(2, 8), torch.randn(2, 8)))
    lower.lower(exported, [(Provided(backend, PluginInfo("test", "test")), {})], {})
    assert originals == []
    assert set(callers) == set(lower._VIEWER_MODULES), callers


class _AllBut:
    """Operator support for every call except ``relu``: an unsupported node in the middle of
    the graph, so that some merges would form a cycle through it."""

    def is_node_supported(self, submodules, node) -> bool:
        return node.op == "call_function" and "relu" not in str(node.target)


def _group_partitioner(module):
    group = pytest.importorskip("executorch.exir.backend.canonical_partitioners.group_partitioner")
    gm = torch.export.export(module, (torch.randn(2, 8), torch.randn(2, 8))).graph_module
    return group, gm


def test_mask_merge_check_agrees_with_executorch_on_every_pair():
    """For every pair of the initial one-node partitions, the mask-based check answers what
    ExecuTorch's own (downstream scan + torch.fx's validate_partition) answers, and both
    say no to some pairs: the unsupported relu sits between them."""
    import collections
    import itertools

    from llmcore.pipeline import lower

    group, gm = _group_partitioner(Branchy())
    original = group.GroupBasedPartitioner._can_merge_partitions
    partitioner = group.GroupBasedPartitioner(gm, _AllBut(), allows_single_node_partition=True)
    partitioner.dependency_viewer = LeanDependencyViewer(gm)  # both checks may read it
    state = dict(partitions_by_id={}, assignment={}, nodes_order={}, partitions_order={},
                 partition_users={}, partition_map=collections.defaultdict(set))
    partitioner._process_all_nodes(itertools.count(), state["partitions_by_id"], state["assignment"],
                                   state["nodes_order"], state["partitions_order"],
                                   state["partition_users"], state["partition_map"])
    by_id = state["partitions_by_id"]
    answers = []
    for p1, p2 in itertools.combinations(by_id, 2):
        expected = original(partitioner, p1, p2, by_id)
        assert lower._can_merge_partitions(partitioner, p1, p2, by_id) == expected, (p1, p2)
        answers.append(expected)
    assert True in answers and False in answers


def test_grouped_partitions_are_the_same_with_the_mask_merge_check():
    from llmcore.pipeline import lower

    group, gm = _group_partitioner(Branchy())

    def proposed():
        partitions = group.GroupBasedPartitioner(gm, _AllBut()).propose_partitions()
        return sorted(sorted(n.name for n in p.nodes) for p in partitions)

    expected = proposed()
    with upstream.applied("lean_dependency_viewers"):
        fast = proposed()
    assert group.GroupBasedPartitioner._can_merge_partitions is not lower._can_merge_partitions
    # relu's producer stays out (a single-node partition): merging it would be the cycle.
    assert fast == expected and expected and not any("linear" in p for p in expected)


def test_legalize_order_is_torch_legalize_graph_order():
    """The in-place sort gives the nodes in the order torch.fx's legalize_graph gives them, on
    a graph with runtime assertions (prioritized) and nodes out of order."""
    from torch.fx.passes.tools_common import legalize_graph

    from llmcore.pipeline.lower import legalize_order

    class Asserting(torch.nn.Module):
        def forward(self, x, pos):
            start = pos[0].item()
            torch._check(start >= 0)
            torch._check(start + x.shape[1] <= 64)
            return torch.relu(x).sum() + x[:, start:start + 1].sum(), (x * 2).mean()

    seq = torch.export.Dim("seq", min=1, max=32)
    gm = torch.export.export(Asserting(), (torch.randn(1, 4), torch.tensor([1])),
                             dynamic_shapes=({1: seq}, None)).graph_module
    # relu moved past its user, as cutting a partition out leaves a graph: only a sort fixes it
    relu = next(n for n in gm.graph.nodes if "relu" in str(n.target))
    gm.graph.output_node().prepend(relu)
    ours = [n.name for n in legalize_order(gm.graph)]
    theirs = [n.name for n in legalize_graph(gm).graph.nodes]
    assert any("assert" in name for name in theirs)
    assert ours == theirs


def test_sorting_in_place_again_gives_torch_s_order_again():
    """torch.fx's legalize_graph copies the nodes into a new graph, so after it each node's
    users are listed in the sorted order, and the next sort (the next delegate cut out) reads
    them so. Sorted in place, the users are listed the same way: two nodes that become ready
    together keep torch's order."""
    import copy

    from executorch.exir import lowered_backend_module
    from torch.fx.passes.tools_common import legalize_graph

    graph = torch.fx.Graph()
    x, p = graph.placeholder("x"), graph.placeholder("p")
    a = graph.call_function(torch.add, (x, p))  # x's first user, ready after p
    b = graph.call_function(torch.neg, (x,))
    graph.output(graph.call_function(torch.mul, (a, b)))
    in_place = torch.fx.GraphModule(torch.nn.Module(), graph)
    copied = copy.deepcopy(in_place)

    def sort_twice(gm, legalize):
        gm = legalize(gm)  # x, p, b, a, ...: b is listed before a
        p_node = next(n for n in gm.graph.nodes if n.name == "p")
        p_node.append(next(n for n in gm.graph.nodes if n.name == "x"))  # p first: a and b ready together
        return [n.name for n in legalize(gm).graph.nodes]

    theirs = sort_twice(copied, legalize_graph)
    with upstream.applied("legalize_in_place"):
        ours = sort_twice(in_place, lowered_backend_module.legalize_graph)
    assert theirs.index("neg") < theirs.index("add")
    assert ours == theirs



class AllKinds(torch.nn.Module):
    """A parameter, a buffer, a lifted constant and a user input."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("offset", torch.ones(4))
        self.table = torch.arange(4.0)  # a plain tensor attribute: a lifted constant

    def forward(self, x):
        return self.linear(x) + self.offset + self.table


def _is_constant(ep, node) -> bool:
    from torch._export.utils import is_buffer, is_lifted_tensor_constant, is_param

    return is_param(ep, node) or is_buffer(ep, node) or is_lifted_tensor_constant(ep, node)


def test_constant_inputs_are_torchs_parameters_buffers_and_constants():
    """The set the config partitioner's ``is_constant_data`` reads while lowering names
    exactly the inputs torch's own ``is_param`` / ``is_buffer`` / ``is_lifted_tensor_constant``
    accept."""
    from llmcore.pipeline.lower import constant_input_names

    ep = torch.export.export(AllKinds(), (torch.randn(2, 4),))
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    expected = {n.name for n in placeholders if _is_constant(ep, n)}
    assert constant_input_names(ep) == expected and len(expected) == 4 and len(placeholders) == 5


def test_constant_inputs_are_listed_once_only_while_matching_nodes():
    """While a config partitioner matches nodes, ``is_constant_data`` gives torch's answers
    for its program (from the set) and for any other; ExecuTorch's function is back after."""
    config = pytest.importorskip("executorch.exir.backend.canonical_partitioners.config_partitioner")
    partitioner = config.ConfigerationBasedPartitioner
    original, is_constant_data = partitioner.get_matched_nodes_from_configs, config.is_constant_data
    ep = torch.export.export(AllKinds(), (torch.randn(2, 4),))
    other = torch.export.export(AllKinds(), (torch.randn(3, 4),))
    answers = []

    def matched(self, program):
        answers.append(config.is_constant_data is not is_constant_data)
        for p in (program, other):
            answers.extend(config.is_constant_data(p, n) == _is_constant(p, n) for n in p.graph.nodes)
        return []

    partitioner.get_matched_nodes_from_configs = matched
    try:
        with upstream.applied("constant_inputs_listed_once"):
            partitioner.get_matched_nodes_from_configs(object(), ep)
        assert answers and all(answers)
        assert config.is_constant_data is is_constant_data
        assert partitioner.get_matched_nodes_from_configs is matched
    finally:
        partitioner.get_matched_nodes_from_configs = original


def _lowered_graph_alive(monkeypatch, forget: bool) -> bool:
    import gc
    import weakref

    from llmcore.pipeline import lower
    from llmcore.plugins import PluginInfo, Provided
    from llmcore.records import Backend

    xnnpack = pytest.importorskip("executorch.backends.xnnpack.partition.xnnpack_partitioner")
    if not forget:
        monkeypatch.setenv(upstream.SWITCH, "forget_lowered_nodes")
    backend = Backend(name="cpu", description="XNNPACK", partitioners=lambda o: [xnnpack.XnnpackPartitioner()])
    exported = torch.export.export(Branchy(), (torch.randn(2, 8), torch.randn(2, 8)))
    edge = lower.lower(exported, [(Provided(backend, PluginInfo("test", "test")), {})], {})
    graph = weakref.ref(edge.exported_program().graph_module)
    del edge, exported
    gc.collect()
    return graph() is not None


def test_a_lowered_program_is_freed_once_dropped(monkeypatch):
    """ExecuTorch's lowering remembers nodes of the graph it lowered (the last node a
    partitioner turned down, the cache of ``is_same_node``), which kept the whole lowered
    program, delegates and constants, alive to the end of the export. Without
    ``forget_lowered_nodes`` the graph module outlives the program here too."""
    from executorch.exir.backend import utils

    assert _lowered_graph_alive(monkeypatch, forget=False)
    monkeypatch.undo()
    assert not _lowered_graph_alive(monkeypatch, forget=True)
    assert utils.is_same_node.cache_info().currsize == 0
