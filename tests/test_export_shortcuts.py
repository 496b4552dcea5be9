"""Work the export skips because nothing it writes depends on it: stack traces on traced
nodes (only an ETRecord reads them), the serializer's repeated type-hint lookups, and the
copy of each weight the program's buffers made (they are the weights' own memory)."""

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


class _Weights(torch.nn.Module):
    """Two linears large enough to be emitted in place (IN_PLACE_CONSTANT_BYTES), one too
    small, and one weight read by two placeholders' worth of uses (the same tensor twice)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.big = torch.nn.Linear(256, 256, bias=False)
        self.small = torch.nn.Linear(256, 4)
        self.register_buffer("shared", torch.randn(256, 256))

    def forward(self, x):
        return self.small(self.big(x) @ self.shared + x @ self.shared.T)


def _emitted(model: torch.nn.Module, in_place: bool):
    """(the program manager, its bytes, the graph's tensors by name) of ``model``'s emission."""
    from executorch.exir import to_edge

    from llmcore.pipeline import emit

    exported = torch.export.export(model, (torch.randn(2, 256),))
    edge = to_edge(exported)
    program = emit.to_executorch(edge, in_place_constants=in_place)
    graph = edge.exported_program()
    tensors = {**graph.state_dict, **{n: t for n, t in graph.constants.items() if isinstance(t, torch.Tensor)}}
    return program, program.buffer, tensors


def _buffer_addresses(program) -> list[int]:
    """The address of each program buffer's bytes where a buffer is a view of other memory
    (``constants_emitted_in_place``), 0 where it holds bytes of its own."""
    import ctypes

    addresses = []
    for buffer in program.executorch_program.constant_buffer:
        parts = [] if isinstance(buffer.storage, bytes) else buffer.storage._buffers
        views = [getattr(part, "view", part) for part in parts]
        addresses.append(ctypes.addressof(ctypes.c_char.from_buffer(views[0])) if views else 0)
    return addresses


def test_large_weights_are_emitted_in_place_and_the_program_is_the_same():
    """``constants_emitted_in_place``: the program's bytes are those of upstream's emission,
    and each large weight's buffer is the weight's own memory, not a copy; a small one's is
    copied as upstream copies it."""
    _, copied_bytes, _ = _emitted(_Weights().eval(), in_place=False)
    program, in_place_bytes, tensors = _emitted(_Weights().eval(), in_place=True)
    assert in_place_bytes == copied_bytes
    addresses = set(_buffer_addresses(program))
    large = [name for name, t in tensors.items() if t.untyped_storage().nbytes() >= upstream.IN_PLACE_CONSTANT_BYTES]
    assert len(large) >= 2  # big's weight, shared
    assert {tensors[name].data_ptr() for name in large} <= addresses
    assert not {t.data_ptr() for name, t in tensors.items() if name not in large} & addresses  # copies


def test_weights_in_memory_that_is_not_torchs_are_emitted_in_place():
    """A weight over a numpy array (as a mapped safetensors file gives them) is emitted from
    where it is, and the program computes what the model does."""
    import numpy as np

    model = _Weights().eval()
    outside = torch.from_numpy(np.ascontiguousarray(model.shared.numpy().copy()))
    model.shared = outside
    want = model(torch.ones(2, 256))
    program, data, _ = _emitted(model, in_place=True)
    assert outside.data_ptr() in _buffer_addresses(program)
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(data).load_method("forward")
    assert torch.allclose(method.execute([torch.ones(2, 256)])[0], want, atol=1e-4)
