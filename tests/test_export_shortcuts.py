"""Work the export skips because nothing it writes depends on it: stack traces on traced
nodes (only an ETRecord reads them) and the serializer's repeated type-hint lookups."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, Union

import torch
import torch.fx.config as fx_config

from llmcore import upstream
from llmcore.pipeline import capture


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.proj = torch.nn.Linear(8, 16)

    def forward(self, tokens):
        return self.proj(torch.relu(self.emb(tokens)))


def _traced_stacks(wanted: bool) -> list:
    before = fx_config.do_not_emit_stack_traces
    with capture.source_lines(wanted):
        exported = capture.capture(_Tiny(), (torch.tensor([[1, 2, 3]]),), 8, False, family="test")
    assert fx_config.do_not_emit_stack_traces == before  # the setting is put back
    return [n.meta.get("stack_trace") for n in exported.graph.nodes if n.op == "call_function"]


def test_nodes_carry_their_source_lines_only_when_asked():
    with_lines = _traced_stacks(True)
    assert with_lines and all(trace and "test_export_shortcuts.py" in trace for trace in with_lines)
    assert not any(_traced_stacks(False))


def test_source_lines_asked_for_inside_a_caller_that_turned_them_off_stay_off():
    """A caller (a test, another tool) that turned stack traces off keeps them off."""
    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        assert not any(_traced_stacks(True))
    finally:
        fx_config.do_not_emit_stack_traces = before


@dataclass
class _Leaf:
    value: Union[int, str]


@dataclass
class _Tree:
    name: str
    leaves: List[_Leaf]


def test_the_serializer_reads_each_class_s_type_hints_once_and_writes_the_same_json():
    from executorch.exir._serialize import _dataclass

    tree = _Tree("t", [_Leaf(1), _Leaf("two"), _Leaf(3)])
    expected = json.dumps(tree, cls=_dataclass._DataclassEncoder)
    assert '"value_type": "str"' in expected  # the branch that reads the hints ran

    original, calls = _dataclass.get_type_hints, []

    def counted(cls, *args, **kwargs):
        calls.append(cls)
        return original(cls, *args, **kwargs)

    _dataclass.get_type_hints = counted
    try:
        with upstream.applied("type_hints_read_once"):
            assert json.dumps(tree, cls=_dataclass._DataclassEncoder) == expected
        assert sorted(c.__name__ for c in calls) == ["_Leaf", "_Tree"]
        assert _dataclass.get_type_hints is counted  # put back
    finally:
        _dataclass.get_type_hints = original
