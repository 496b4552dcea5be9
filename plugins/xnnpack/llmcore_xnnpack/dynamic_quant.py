"""The eager reference of an ``int8-dynamic`` program: activations quantized per token.

XNNPACK's int8-dynamic recipe (pt2e, ``is_dynamic=True``) writes each linear's input as
``choose_qparams.tensor -> quantize_per_tensor.tensor -> dequantize_per_tensor.tensor``:
one scale and zero point for the whole activation tensor. XNNPACK does not compute that:
it turns the chain into a dynamically quantized tensor with one non-batch dimension, so
every row (every token) gets its own scale and zero point, from the row's own range
(including 0), asymmetric int8. Per token is the more accurate of the two, and for a
prompt whose tokens differ in range (an LLM's first token usually does) the two differ
a lot: SmolLM2's parity line read max |diff| 10.7, top-1 50% against the per-tensor graph.

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
