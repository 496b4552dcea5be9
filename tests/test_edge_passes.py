"""to_edge's conversion with its operator-local passes fused (llmcore/pipeline/edge.py),
against ExecuTorch's own ``_generate_edge_program``."""

import inspect

import pytest
import torch

from llmcore.pipeline import edge


class _Mixed(torch.nn.Module):
    """Operators that each fused pass rewrites: a transpose (NormalizeTranspose), views
    (view_copy), a scalar operand (ScalarToTensor), mixed dtypes (RemoveMixedTypeOperators),
    a symbolic size, and ATen operators made edge ones (OpReplace)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8))
        self.register_buffer("steps", torch.arange(8, dtype=torch.int32))

    def forward(self, x):
        y = x @ self.weight.t()
        y = y.view(x.shape[0], 2, 4).transpose(1, 2).reshape(x.shape[0], 8)
        y = torch.add(y, self.steps) * 0.5  # int32 buffer with fp32 values, a scalar
        return y.sum(dim=-1, keepdim=True) / x.shape[0] + torch.ones_like(y)


def _aten_program():
    """Decomposed to core ATen, as to_edge converts it."""
    from executorch.exir.program import _program as exir
    from torch.export import Dim

    torch.manual_seed(0)  # the same weights in every program compared
    x = torch.randn(3, 8)
    exported = torch.export.export(_Mixed(), (x,), dynamic_shapes=({0: Dim("rows", min=2, max=16)},), strict=False)
    return exported.run_decompositions(exir._default_decomposition_table())


def _graph(program):
    return [
        (n.op, str(n.target), str(n.args), str(n.kwargs), str(getattr(n.meta.get("val"), "shape", None)),
         n.meta.get("debug_handle"))
        for n in program.graph.nodes
    ]


def test_the_fused_conversion_gives_executorch_s_edge_program():
    from executorch.exir import EdgeCompileConfig
    from executorch.exir.program import _program as exir

    config = EdgeCompileConfig()
    expected = exir._generate_edge_program(config, _aten_program())
    got = edge.generate_edge_program(config, _aten_program())
    assert _graph(got) == _graph(expected)
    assert got.graph_signature == expected.graph_signature
    x = torch.randn(5, 8)
    torch.testing.assert_close(got.module()(x), expected.module()(x), rtol=0, atol=0)


def test_the_adjacent_operator_local_passes_run_as_one():
    from executorch.exir.program import _program as exir

    passes = [exir.RemoveNonCoreAtenOpGraphAssertsPass(), exir.ReplaceViewOpsWithViewCopyOpsPass()]
    pre, _ = exir._get_aten_to_edge_passes(exir.EdgeCompileConfig())
    passes += list(pre) + [exir.OpReplacePass(), exir.MemoryFormatOpsPass()]
    names = [type(getattr(p, "__wrapped__", p)).__name__ for p in edge.fused(passes)]
    assert "NormalizeTransposePass+ReplaceBrokenOpsWithFunctionalOpsPass+ScalarToTensorPass+SymToTensorPass" in names
    assert "RemoveMixedTypeOperators+OpReplacePass+MemoryFormatOpsPass" in names
    assert len(names) == len(passes) - 5  # seven retraces become two


def test_every_fused_pass_rewrites_operators_only():
    """Authority: the passes themselves. Each listed pass derives from ExportPass directly and
    defines nothing but ``call_operator`` (and an argument-free ``__init__``; for
    ScalarToTensorPass a ``call`` that only records whether it changed anything)."""
    from executorch.exir.pass_base import ExportPass
    from executorch.exir.program import _program as exir

    pre, _ = exir._get_aten_to_edge_passes(exir.EdgeCompileConfig())
    classes = {type(getattr(p, "__wrapped__", p)) for p in pre} | {exir.OpReplacePass, exir.MemoryFormatOpsPass}
    listed = {c for c in classes if c.__name__ in edge.OPERATOR_LOCAL_PASSES}
    assert {c.__name__ for c in listed} == edge.OPERATOR_LOCAL_PASSES
    for cls in listed:
        assert cls.__bases__ == (ExportPass,), cls
        defined = {name for name, value in vars(cls).items() if callable(value)}
        allowed = {"call_operator", "__init__"} | ({"call"} if cls.__name__ == "ScalarToTensorPass" else set())
        assert defined <= allowed, (cls, defined - allowed)
        if "__init__" in defined:
            assert list(inspect.signature(cls.__init__).parameters) == ["self"], cls


def test_another_executorch_s_conversion_fails_loudly_and_runs_unfused_when_switched_off(monkeypatch):
    """The fused conversion repeats ``_generate_edge_program``'s steps: on a release whose
    function is not the one mirrored it refuses, naming the patch; switched off, ExecuTorch's
    own function runs."""
    import dataclasses

    from executorch.exir import EdgeCompileConfig
    from executorch.exir.program import _program as exir

    from llmcore import upstream

    called = []
    original = exir._generate_edge_program
    monkeypatch.setattr(exir, "_generate_edge_program", lambda *a, **k: called.append(a) or original(*a, **k))
    record = upstream.PATCHES["fused_edge_passes"]
    another = {target: ("another",) for target in record.relies_on}
    monkeypatch.setitem(upstream.PATCHES, record.name, dataclasses.replace(record, relies_on=another))
    with pytest.raises(upstream.UpstreamPatchError, match="fused_edge_passes"):
        edge.generate_edge_program(EdgeCompileConfig(), _aten_program())
    assert not called
    monkeypatch.setenv(upstream.SWITCH, "fused_edge_passes")
    edge.generate_edge_program(EdgeCompileConfig(), _aten_program())
    assert len(called) == 1


@pytest.mark.parametrize("skip_dim_order", [False, True])
def test_both_dim_order_settings_match_executorch(skip_dim_order):
    from executorch.exir import EdgeCompileConfig
    from executorch.exir.program import _program as exir

    config = EdgeCompileConfig(_skip_dim_order=skip_dim_order)
    assert _graph(edge.generate_edge_program(config, _aten_program())) == _graph(
        exir._generate_edge_program(config, _aten_program()))
