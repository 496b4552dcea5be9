"""Delegate calls answered from their records (llmcore/pipeline/delegates.py): every call
of a decoder's program is, in the caller's sizes, and what a record cannot answer goes to
ExecuTorch's own rule. That the program stays the same byte for byte is checked with the
other lowering shortcuts, in plugins/xnnpack/tests/test_lowering.py."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from llmcore import upstream
from llmcore.pipeline.delegates import _Unrecorded, recorded_outputs


def _lowered_tiny_llama(monkeypatch):
    """The edge program of a tiny llama, 8da4w, lowered to XNNPACK (a delegate per layer,
    the KV cache between them), as the export hands it to the post-passes."""
    pytest.importorskip("llmcore_llama")
    pytest.importorskip("llmcore_xnnpack")
    from llmcore.pipeline import lower
    from llmcore.testing.conformance import export_tiny

    lowered = []
    original = lower.lower

    def keeping_a_copy(*args, **kwargs):
        # a copy: to_executorch rewrites the program it is handed (out variants) in place
        result = original(*args, **kwargs)
        lowered.append(copy.deepcopy(result))
        return result

    monkeypatch.setattr(lower, "lower", keeping_a_copy)
    export_tiny("xnnpack", "llama", quantize="8da4w", cache=False)
    return lowered[0]


def test_every_delegate_call_of_a_decoder_is_answered_from_its_record(monkeypatch):
    """The program is the same byte for byte either way: plugins/xnnpack/tests/test_lowering.py."""
    from executorch.exir.passes.spec_prop_pass import SpecPropPass

    edge = _lowered_tiny_llama(monkeypatch)
    with upstream.applied("recorded_delegate_outputs") as counts:
        edge.transform([SpecPropPass()])
    assert counts["recorded"] >= 3 and counts["traced"] == 0, counts


class Doubling(torch.nn.Module):
    def forward(self, x):
        return torch.cat([x, x], dim=1) + 1  # [1, 2 * s, 4]: a size that is an expression


class Plain(torch.nn.Module):
    def forward(self, x):
        return (x * 2,)


def _program(module):
    seq = torch.export.Dim("seq", min=2, max=32)
    return torch.export.export(module, (torch.randn(1, 5, 4),), dynamic_shapes=({1: seq},))


def test_outputs_come_from_the_record_in_the_callers_sizes():
    """The record says [1, s, 4]; a call with 7 rows gets [1, 7, 4]."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    lowered = SimpleNamespace(original_module=_program(Plain()))
    mode = FakeTensorMode()
    x = mode.from_tensor(torch.randn(1, 7, 4))
    with mode:
        (out,) = recorded_outputs(lowered, (x,))
    assert tuple(out.shape) == (1, 7, 4) and out.dtype == torch.float32 and out.is_contiguous()


@pytest.mark.parametrize("module, args, why", [
    (Doubling(), (torch.randn(1, 7, 4),), "expression"),
    (Plain(), (torch.randn(1, 7, 4, dtype=torch.float64),), "differs"),
    (Plain(), (torch.randn(1, 7, 4), torch.randn(1)), "count"),
], ids=["output-size-expression", "dtype-differs", "argument-count"])
def test_what_the_record_cannot_answer_is_refused(module, args, why):
    from torch._subclasses.fake_tensor import FakeTensorMode

    lowered = SimpleNamespace(original_module=_program(module))
    with FakeTensorMode(), pytest.raises(_Unrecorded, match=why):
        recorded_outputs(lowered, args)
