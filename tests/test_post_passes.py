"""Post-passes: one that names the operators it rewrites runs only where the program calls
one of them (each run re-traces the whole program). And ``to_executorch``'s quant fusion,
skipped where the graph calls no quantize or dequantize operator: every pattern it
matches starts from one."""

from __future__ import annotations

import pytest
import torch

from llmcore import upstream
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


def test_every_quant_fusion_pattern_starts_from_a_quantize_operator():
    patterns = pytest.importorskip("executorch.exir.passes._quant_patterns_and_replacements")
    found = patterns.get_quant_patterns_and_replacements({})
    assert len(found) > 10
    for pattern, _replacement, _filters in found:
        graph = pattern if isinstance(pattern, torch.fx.GraphModule) else torch.fx.symbolic_trace(pattern)
        assert any(emit.is_quantize_operator(node) for node in graph.graph.nodes), graph.code


def test_quant_fusion_runs_where_the_graph_quantizes():
    """A graph with a dequantize outside delegates takes ExecuTorch's pass; one without
    takes the dead-code and constant-propagation steps only, and both keep the pass
    module's function afterwards."""
    from executorch.exir.program import _program

    original = _program.quant_fusion_and_const_prop_pass
    calls = []
    quantized = _dequantizing_edge()
    plain = _edge()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_program, "quant_fusion_and_const_prop_pass", lambda p: calls.append(p) or original(p))
        with upstream.applied("quant_fusion_only_where_quantized"):
            _program.quant_fusion_and_const_prop_pass(quantized.exported_program())
            _program.quant_fusion_and_const_prop_pass(plain.exported_program())
        assert _program.quant_fusion_and_const_prop_pass is not original
    assert _program.quant_fusion_and_const_prop_pass is original
    assert len(calls) == 1


class Dequantizing(torch.nn.Module):
    def forward(self, q):
        return torch.ops.quantized_decomposed.dequantize_per_tensor(q, 0.5, 0, -128, 127, torch.int8) * 2


def _dequantizing_edge():
    exir = pytest.importorskip("executorch.exir")
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)

    program = torch.export.export(Dequantizing(), (torch.randint(-128, 127, (4,), dtype=torch.int8),))
    return exir.to_edge(program)
