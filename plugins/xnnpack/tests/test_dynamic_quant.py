"""int8-dynamic's parity reference quantizes activations per token, as XNNPACK does.

Authority: the XNNPACK program itself, run by the ExecuTorch runtime. Two linears whose
input rows differ in range by 10^4 (an LLM's first token against the others): the graph
pt2e writes (one activation scale per tensor) rounds the small rows to almost nothing,
the program keeps them; :func:`per_token_activations` must compute what the program
computes, and the per-tensor graph must not (or the test could not tell them apart).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from llmcore.pipeline import quantize
from llmcore.testing.conformance import registry
from llmcore_xnnpack.dynamic_quant import per_token_activations


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = nn.Linear(64, 96)
        self.b = nn.Linear(96, 32)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 6, 64, generator=gen) * 0.01
    x[0, 0] *= 1e4  # one loud row
    return (x,)


def _program_output(converted, inputs):
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from llmcore_xnnpack.partition import partitioners

    exported = torch.export.export(converted, inputs)
    options = {"per_op_mode": False, "fp32_only": False, "share_tied_weights": True}
    program = to_edge_transform_and_lower(exported, partitioner=partitioners(options)).to_executorch()
    loaded = Runtime.get().load_program(program.buffer)
    return loaded.load_method("forward").execute(list(inputs))[0]


def test_per_token_reference_is_what_xnnpack_computes():
    provided = registry().get("quantizers", "int8-dynamic", stage="test")
    inputs = _inputs()
    exported = torch.export.export(TwoLinears().eval(), inputs)
    converted = quantize.quantize_graph(exported, provided, {"per_channel": True}, [inputs])
    per_tensor = copy.deepcopy(converted)
    program = _program_output(converted, inputs)

    reference = per_token_activations(converted)
    assert not any("per_tensor.tensor" in str(n.target) for n in reference.graph.nodes)
    with torch.no_grad():
        per_token_out, per_tensor_out = reference(*inputs), per_tensor(*inputs)
    quiet_rows = slice(1, None)  # the rows the per-tensor scale crushes
    scale = program[0, quiet_rows].abs().max()
    per_token_err = (per_token_out - program)[0, quiet_rows].abs().max() / scale
    per_tensor_err = (per_tensor_out - program)[0, quiet_rows].abs().max() / scale
    # observed: per token 1.8e-7 relative (the same integers), per tensor 0.52
    assert per_token_err < 1e-3, per_token_err
    assert per_tensor_err > 0.05, per_tensor_err
    torch.testing.assert_close(per_token_out[0, 0], program[0, 0], rtol=1e-3, atol=1e-3)


def test_other_users_of_a_dynamic_scale_are_refused():
    gm = torch.fx.symbolic_trace(nn.Identity())
    qd = pytest.importorskip("torchao.quantization.pt2e") and torch.ops.quantized_decomposed
    graph = gm.graph
    x = next(iter(graph.nodes))
    with graph.inserting_after(x):
        choose = graph.call_function(qd.choose_qparams.tensor, (x, -128, 127, 1e-5, torch.int8))
    with graph.inserting_after(choose):
        scale = graph.call_function(__import__("operator").getitem, (choose, 0))
    with graph.inserting_after(scale):
        odd = graph.call_function(torch.ops.aten.mul.Tensor, (x, scale))
    graph.output_node().args = (odd,)
    with pytest.raises(ValueError, match="reads a dynamic scale"):
        per_token_activations(gm)


@pytest.mark.parametrize("axis, with_zero_points", [(0, True), (0, False), (1, True)])
def test_lean_dequantize_gives_the_decomposed_ops_values_bit_for_bit(axis, with_zero_points):
    from llmcore_xnnpack.dynamic_quant import dequantize_per_channel_lean

    qd = torch.ops.quantized_decomposed
    gen = torch.Generator().manual_seed(axis)
    q = torch.randint(-127, 128, (96, 40), dtype=torch.int8, generator=gen)
    channels = q.shape[axis]
    scales = torch.rand(channels, generator=gen) * 0.05 + 1e-4
    zero_points = torch.randint(-3, 4, (channels,), generator=gen) if with_zero_points else None
    want = qd.dequantize_per_channel.default(q, scales, zero_points, axis, -127, 127, torch.int8)
    got = dequantize_per_channel_lean(q, scales, zero_points, axis, -127, 127, torch.int8)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


def test_the_int8_dynamic_reference_dequantizes_weights_leanly_with_the_same_output():
    from llmcore_xnnpack import _per_token_reference
    from llmcore_xnnpack.dynamic_quant import dequantize_per_channel_lean

    provided = registry().get("quantizers", "int8-dynamic", stage="test")
    inputs = _inputs()
    exported = torch.export.export(TwoLinears().eval(), inputs)
    converted = quantize.quantize_graph(exported, provided, {"per_channel": True}, [inputs])
    plain = per_token_activations(copy.deepcopy(converted))
    lean = _per_token_reference(converted)
    targets = [n.target for n in lean.graph.nodes]
    assert dequantize_per_channel_lean in targets
    assert torch.ops.quantized_decomposed.dequantize_per_channel.default not in targets
    with torch.no_grad():
        assert torch.equal(lean(*inputs), plain(*inputs))
