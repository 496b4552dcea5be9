"""The qnn-8a8w and qnn-16a4w recipes quantize the tiny models (QnnQuantizer, pt2e),
without a Qualcomm SDK and without any network access.

The quantized graph is compared with the float one on the calibration prompt. Random
tiny models have logits within about +-1; the bounds are loose sanity checks (the
quantizer really quantized: q/dq nodes exist, and the result stays close), not accuracy
claims: 8a8w max |diff| <= 0.25, 16a4w (4-bit weights) <= 0.5.
"""

from __future__ import annotations

import pytest
import torch

from llmcore.testing.conformance import registry, transformed_tiny

BOUNDS = {"qnn-8a8w": 0.25, "qnn-16a4w": 0.5}


def _defaults(recipe):
    return {k: default for k, (_, default, _) in recipe.options.items()}


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_recipe_quantizes_tiny_model(family, name, monkeypatch):
    from llmcore.pipeline import capture, quantize

    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    provided = registry().get("quantizers", name, stage="quantize")
    module, context, _ = transformed_tiny(family, ["qnn"], max_seq_len=64)
    tokens = torch.randint(0, 257, (1, 12), generator=torch.Generator().manual_seed(3)).tolist()[0]
    inputs = capture.example_inputs(tokens, context.use_kv_cache)
    exported = capture.capture(module, inputs, 64, context.use_kv_cache, family=family)
    with torch.no_grad():
        want = exported.module()(*inputs)
    converted = quantize.quantize_graph(exported, provided, _defaults(provided.record), [inputs])
    ops = {str(n.target) for n in converted.graph.nodes if n.op == "call_function"}
    assert any("quantize_per" in op for op in ops), sorted(ops)
    # calibration wrote the cache rows [0, 12); running at input_pos 0 rewrites the same rows
    with torch.no_grad():
        got = converted(*inputs)
    diff = float((got - want).abs().max())
    assert torch.isfinite(got).all() and diff <= BOUNDS[name], (name, family, diff)
    # the pipeline exports the converted module again
    capture.capture(converted, inputs, 64, context.use_kv_cache, family=family, what="the quantized model")


def test_recipes_are_meant_for_qnn_only():
    from llmcore.errors import LlmcoreError
    from llmcore.pipeline import quantize

    with pytest.raises(LlmcoreError, match="qnn"):
        quantize.resolve_recipe("qnn-8a8w", {}, ["xnnpack"], registry())
