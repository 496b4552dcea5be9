"""The eager reference of an ``int8-dynamic`` program: activations quantized per token.

XNNPACK's int8-dynamic recipe (pt2e, ``is_dynamic=True``) writes each linear's input as
``choose_qparams.tensor -> quantize_per_tensor.tensor -> dequantize_per_tensor.tensor``:
one scale and zero point for the whole activation tensor. XNNPACK does not compute that:
it turns the chain into a dynamically quantized tensor with one non-batch dimension, so
every row (every token) gets its own scale and zero point, from the row's own range
(including 0), asymmetric int8. Per token is the more accurate of the two, and for a
prompt whose tokens differ in range (an LLM's first token usually does) the two differ
a lot (docs/quantization.md, "Notes": ``int8-dynamic``'s parity line).

:func:`per_token_activations` rewrites the converted graph to ``quantized_decomposed``'s
per-token ops, so that the parity check compares the program with what it is meant to
compute, and a lowering fault is not hidden in the quantizer's difference.
"""

from __future__ import annotations

import torch

from llmcore_xnnpack.qlinear import _qd as qd


def per_token_activations(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrites (in place) every dynamic per-tensor activation chain to per-token; returns it."""
    graph = graph_module.graph
    rewritten = 0
    for choose in list(graph.nodes):
        if choose.op != "call_function" or choose.target != qd.choose_qparams.tensor:
            continue
        source, dtype = choose.args[0], choose.args[4]
        choose.target = qd.choose_qparams_per_token_asymmetric.default
        choose.args = (source, dtype)
        for item in choose.users:
            for user in list(item.users):
                if user.target in (qd.quantize_per_token.default, qd.dequantize_per_token.default):
                    continue  # reads both the scale and the zero point: done already
                if user.target == qd.quantize_per_tensor.tensor:
                    user.target = qd.quantize_per_token.default
                elif user.target == qd.dequantize_per_tensor.tensor:
                    user.target = qd.dequantize_per_token.default
                    user.args, user.kwargs = (*user.args[:6], torch.float32), {}
                else:
                    raise ValueError(f"int8-dynamic reference: {user.format_node()} reads a dynamic scale")
        rewritten += 1
    if rewritten:
        graph.lint()
        graph_module.recompile()
    return graph_module


def dequantize_per_channel_lean(input, scales, zero_points, axis, quant_min, quant_max, dtype, *, out_dtype=None):
    """``quantized_decomposed.dequantize_per_channel``'s values with one temporary the size of
    the weight. The decomposed op subtracts the zero points in int64 and then multiplies: for
    SmolLM2's 49152 x 576 output layer that is 226 MB of int64 beside 113 MB of floats, which
    raised the eager reference's peak in an ``int8-dynamic`` export (docs/performance.md,
    "Measurements behind the code").
    ``q - zero_point`` is a small integer, exact in float32, so subtracting after the cast
    and multiplying in place rounds once, as the decomposed op does."""
    work = torch.promote_types(scales.dtype, torch.float32)
    shape = [1] * input.dim()
    shape[axis] = -1
    out = input.to(work)
    if zero_points is not None:
        out.sub_(zero_points.view(shape).to(work))
    out.mul_(scales.view(shape).to(work))
    return out.to(out_dtype or torch.float32)


def lean_weight_dequantize(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrites (in place) the reference graph's per-channel dequantizes to
    :func:`dequantize_per_channel_lean`, each moved to just before the first node that
    reads it. The converted graph dequantizes every weight at its top, so running it held
    all of them as fp32 at once (SmolLM2: 513 MB); moved, each is freed after its linear.
    The same values, a fraction of the memory. Only the eager reference runs this graph;
    the program was captured before."""
    graph = graph_module.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    rewritten = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == qd.dequantize_per_channel.default:
            node.target = dequantize_per_channel_lean
            if node.users:
                min(node.users, key=order.__getitem__).prepend(node)
            rewritten += 1
    if rewritten:
        graph.lint()
        graph_module.recompile()
    return graph_module
