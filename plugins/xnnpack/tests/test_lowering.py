"""The faster lowering (llmcore_xnnpack.lowering, llmcore.pipeline.repeated) writes the
program ExecuTorch would.

Authority: the same export with every shortcut turned off, i.e. ExecuTorch's own
``to_edge_transform_and_lower`` on the whole graph (``--whole-graph-lowering``), every
post-pass run (none skipped for want of its operators), and every patch of
``llmcore.upstream`` switched off (``LLMCORE_UPSTREAM_PATCHES_OFF=all``): ExecuTorch's own
decomposition path, partitioners, graph sorting and serializer, every XNNPACK preprocess
pass on every partition, ``to_executorch``'s quant fusion pass, and every delegate's graph
traced again by the post-passes and ``to_executorch``. The `.pte` files must be identical
byte for byte, so every delegate, every constant and the graph around them are what they were.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import logging

import pytest
import torch

from llmcore import upstream
from llmcore.pipeline import emit, lower
from llmcore.testing.conformance import export_tiny
from llmcore_xnnpack import lowering

# (family, recipe, layers, how many blocks to_edge runs on before the rest are copied; 0: none)
CASES = [
    ("llama", "8da4w", 4, 2),
    ("llama", None, 3, 2),
    ("nanogpt", None, 4, 2),
    # pt2e's quantize/dequantize nodes belong to no module: gathered into their blocks first
    ("nanogpt", "int8-dynamic", 4, 2),
    # layers of two kinds taking turns (Gemma 2: sliding, global, ...): blocks 0-3, then copies
    ("gemma2", "8da4w", 6, 4),
    # Gemma 3's pattern with a period of 3 (sliding, sliding, global): blocks 0-4, then copies
    ("gemma3", None, 8, 5),
]


def _deeper_tiny(monkeypatch, family: str, layers: int) -> None:
    """The tiny config with ``layers`` layers: two give no partition that repeats. The Gemma
    cases are the llama family's tiny config with the Gemma plugin's switches (the same
    decoder), every third layer global for Gemma 3."""
    if family in ("gemma2", "gemma3"):
        from llmcore_gemma import _configs
        from llmcore_llama import config

        period = 2 if family == "gemma2" else 3
        sliding = tuple(i for i in range(layers) if (i + 1) % period)
        gemma = dataclasses.replace(_configs()[f"{family}-tiny"], n_layers=layers, sliding_layers=sliding)
        monkeypatch.setitem(config.CONFIGS, "tiny", gemma)
    elif family == "llama":
        from llmcore_llama import config

        monkeypatch.setitem(config.CONFIGS, "tiny", dataclasses.replace(config.CONFIGS["tiny"], n_layers=layers))
    else:
        from llmcore_nanogpt import model

        monkeypatch.setitem(model.CONFIGS, "tiny", dataclasses.replace(model.CONFIGS["tiny"], n_layer=layers))


def _export(tmp_path, name: str, family: str, quantize):
    out = tmp_path / name / f"{family}.pte"
    out.parent.mkdir()
    family = "llama" if family.startswith("gemma") else family
    return export_tiny("xnnpack", family, quantize=quantize, cache=False, output=out)


def _whole_graph(lower_fn):
    """``lower.lower`` as ``--whole-graph-lowering`` runs it."""

    @functools.wraps(lower_fn)
    def whole(*args, **kwargs):
        return lower_fn(*args, **{**kwargs, "repeated": False})

    return whole


class _EveryOperator(set):
    """Called operators that include whatever a post-pass rewrites: every post-pass runs."""

    def __and__(self, other):
        return set(other)


def _every_operator(edge):
    return _EveryOperator()


@pytest.mark.parametrize("family,quantize,layers,converted", CASES)
def test_same_program_as_executorch_lowering(tmp_path, monkeypatch, caplog, family, quantize, layers, converted):
    _deeper_tiny(monkeypatch, family, layers)
    with caplog.at_level(logging.INFO):
        fast = _export(tmp_path, "fast", family, quantize)
    messages = [r.getMessage() for r in caplog.records]
    summary = [m for m in messages if "preprocess passes skipped" in m]
    assert summary, "the remembered pass manager did not run"
    skipped = int(summary[0].split("; ")[1].split()[0])
    assert skipped > 0, summary[0]
    transplanted = int(summary[0].split("; ")[2].split()[0])  # partitions given a passed graph
    assert transplanted > 0 or not converted, summary[0]
    copied = [m for m in messages if m.startswith(f"to_edge ran on {converted} of {layers} ")]
    assert bool(copied) == bool(converted), [m for m in messages if "whole graph" in m or "to_edge ran" in m]
    one_retrace = [m for m in messages if "decomposed the kept blocks in one retrace" in m]
    assert bool(one_retrace) == bool(converted)

    with monkeypatch.context() as m:
        m.setenv(upstream.SWITCH, "all")
        m.setattr(lower, "lower", _whole_graph(lower.lower))
        m.setattr(emit, "called_operators", _every_operator)
        reference = _export(tmp_path, "reference", family, quantize)

    fast_bytes = fast.pte.read_bytes()
    reference_bytes = reference.pte.read_bytes()
    assert len(fast_bytes) == len(reference_bytes)
    assert fast_bytes == reference_bytes



def test_pattern_passes_are_skipped_only_where_no_pattern_can_match():
    """Authority: ExecuTorch's own pattern graphs, the ones its passes match with. Every
    pattern of each skippable pass holds the operator ``could_match`` looks for, so a
    partition without that operator holds no match and the skipped pass changed nothing."""
    from executorch.backends.xnnpack._passes.convert_to_sdpa import ConvertToSDPAPass
    from executorch.backends.xnnpack._passes.convert_to_upsample_bilinear2d import ConvertToUpsampleBilinear2d
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa

    patterns = {ConvertToUpsampleBilinear2d: bilinear_2d.get_graphs(), ConvertToSDPAPass: sdpa.get_graphs()}
    assert set(lowering.PATTERN_PASS_OPERATORS) == {p.__name__ for p in patterns}
    for pass_, graphs in patterns.items():
        assert graphs
        for graph in graphs:
            holder = type("Program", (), {"graph": graph.graph})
            assert lowering.could_match(pass_, holder), (pass_.__name__, graph.graph)
            ops = [n for n in graph.graph.nodes if n.op == "call_function"]
            without = torch.fx.Graph()
            for node in ops:
                if getattr(node.target, "__name__", None) != lowering.PATTERN_PASS_OPERATORS[pass_.__name__]:
                    without.call_function(node.target)
            assert not lowering.could_match(pass_, type("Program", (), {"graph": without}))


def test_node_passes_are_skipped_only_where_their_operators_are_missing():
    """Authority: the passes themselves. Each skippable node pass is one XNNPACK runs, and
    where a pass lists the operators it rewrites, those are the ones ``could_match`` looks
    for. (That a skipped pass would have changed nothing is what
    ``test_same_program_as_executorch_lowering`` shows, byte for byte, against every pass run.)"""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.backends.xnnpack._passes.convert_to_linear import ConvertToLinearPass
    from executorch.backends.xnnpack._passes.decompose_batch_norm import DecomposeBatchNorm
    from executorch.backends.xnnpack._passes.fuse_activation_pass import FuseActivationPass
    from executorch.exir.dialects._ops import ops as exir_ops

    manager = XNNPACKPassManager.__new__(XNNPACKPassManager)
    XNNPACKPassManager.__init__(manager, exported_program=None)
    run = {p.__name__: p for p in manager.passes}
    assert set(lowering.NODE_PASS_OPERATORS) <= set(run)
    for pass_, listed in ((DecomposeBatchNorm, DecomposeBatchNorm.BATCH_NORM_OPS),
                          (FuseActivationPass, FuseActivationPass.FUSEABLE_ACTIVATIONS),
                          (ConvertToLinearPass, ConvertToLinearPass.targets)):
        assert set(lowering.NODE_PASS_OPERATORS[pass_.__name__]) == {op.__name__ for op in listed}
    for name, operators in lowering.NODE_PASS_OPERATORS.items():
        source = inspect.getsource(run[name])  # each operator is one the pass looks for
        assert all(op_name in source for op_name in operators), name
        graph = torch.fx.Graph()
        graph.call_function(exir_ops.edge.aten.add.Tensor)
        holder = type("Program", (), {"graph": graph})
        assert not lowering.could_match(run[name], holder)
        for op_name in operators:
            packet, overload = op_name.split(".")[1:]
            with_op = torch.fx.Graph()
            node = with_op.call_function(getattr(getattr(exir_ops.edge.aten, packet), overload))
            assert getattr(node.target, "__name__", None) == op_name
            assert lowering.could_match(run[name], type("Program", (), {"graph": with_op}))


def test_metadata_passes_are_skipped_only_where_no_node_carries_their_key():
    """Authority: the pass's source. A pass listed in ``META_PASS_KEYS`` reads only that
    metadata key; a partition without it is skipped, one node carrying it is not."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.exir.dialects._ops import ops as exir_ops

    manager = XNNPACKPassManager.__new__(XNNPACKPassManager)
    XNNPACKPassManager.__init__(manager, exported_program=None)
    run = {p.__name__: p for p in manager.passes}
    for name, key in lowering.META_PASS_KEYS.items():
        source = inspect.getsource(run[name])
        read = set(re.findall(r"meta\[['\"](\w+)['\"]\]", source)) | set(re.findall(r"['\"](\w+)['\"] in \w+\.meta", source))
        assert read == {key}, (name, read)
        graph = torch.fx.Graph()
        node = graph.call_function(exir_ops.edge.aten.add.Tensor)
        program = type("Program", (), {"graph": graph})
        assert not lowering.could_match(run[name], program)
        node.meta[key] = {"annotated": True}
        assert lowering.could_match(run[name], program)


@pytest.mark.parametrize("patch", lowering.PATCHES, ids=lambda p: p.name)
def test_each_patch_was_written_for_the_installed_releases(patch):
    """This plugin's patches of ExecuTorch, in llmcore.upstream's registry like the core's
    (tests/test_upstream.py checks those): fails on an upgrade that leaves a range or
    rewrites a function a patch replaces or relies on."""
    assert upstream.PATCHES[patch.name] is patch
    assert not upstream.problems(patch), f"{patch.name}: " + "; ".join(upstream.problems(patch))


def test_switched_off_the_partitioner_keeps_its_filter(monkeypatch):
    ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    ops = [torch.ops.aten.linear.default]

    def keep(node):
        return True

    assert lowering.ops_to_not_decompose(ep, ops, keep)[1] is None
    monkeypatch.setenv(upstream.SWITCH, "ops_kept_without_filter")
    assert lowering.ops_to_not_decompose(ep, ops, keep) == (ops, keep)
