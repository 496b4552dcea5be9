"""Post-passes: one that names the operators it rewrites runs only where the program calls
one of them (each run re-traces the whole program)."""

from __future__ import annotations

import pytest
import torch

from llmcore.pipeline import emit
from llmcore.plugins import PluginInfo, Provided
from llmcore.records import PostPass


class MatMul(torch.nn.Module):
    def forward(self, x, w):
        return torch.relu(x @ w)


def _edge():
    exir = pytest.importorskip("executorch.exir")
    return exir.to_edge(torch.export.export(MatMul(), (torch.randn(2, 3), torch.randn(3, 4))))


def _recording_pass(name: str, rewrites: tuple, ran: list) -> Provided:
    from torch.fx.passes.infra.pass_base import PassResult

    def create():
        def run(graph_module):
            ran.append(name)
            return PassResult(graph_module, False)

        return run

    record = PostPass(name=name, description="records that it ran", create=create, rewrites=rewrites)
    return Provided(record, PluginInfo("test", "test"))


def test_called_operators_are_the_graphs_own():
    called = emit.called_operators(_edge())
    assert {"aten::mm", "aten::relu"} <= called
    assert "aten::convolution" not in called


def test_a_pass_runs_only_where_an_operator_it_rewrites_is_called():
    ran: list[str] = []
    passes = [
        _recording_pass("mm-pass", ("aten::convolution", "aten::mm"), ran),
        _recording_pass("conv-pass", ("aten::convolution",), ran),
        _recording_pass("every-program", (), ran),
    ]
    emit.apply_post_passes(_edge(), passes)
    assert ran == ["mm-pass", "every-program"]
