"""Lowering's memory: the partitioners' dependency sets, kept as bitmasks, give the same answers."""

from __future__ import annotations

import pytest
import torch

from llmcore.pipeline.lower import LeanDependencyViewer, lean_dependency_viewers


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
    with lean_dependency_viewers():
        assert partitioner._DependencyViewer is LeanDependencyViewer
    assert partitioner._DependencyViewer is original
