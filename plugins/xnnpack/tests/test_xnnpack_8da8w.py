"""The ``8da8w`` recipe: every linear at int8 per output channel, activations int8 per token
on two rows (``outlier_split``, the default) or one.

The tiny nanoGPT (random weights, seed 0) is run by the ExecuTorch runtime through
``test_xnnpack_8da4w``'s prefills and decode steps, against the fp32 model (the
quantization error) and the same model quantized eagerly by the recipe (what lowering adds:
XNNPACK's own rounding and accumulation order). Observed max |logit diff|: vs fp32 0.0076
(two rows) and 0.0066 (one row: this random model's activations have no outliers for the
split to isolate; test_qlinear checks the gain on activations that do); vs the quantized
eager model 0.0043 and 0.0040. Bounds 0.03 and 0.01, and the same argmax as the fp32 model
at every step.
"""

from __future__ import annotations

import pytest
import torch
from test_xnnpack_8da4w import fp32_tiny, worst_diffs

from llmcore.runtime import Program
from llmcore_xnnpack.qlinear import ChannelInt8Linear
from llmcore_xnnpack.recipes import quantize_8da8w

DEFAULTS = {"embedding_bits": 0, "embedding_group_size": 32, "outlier_split": True, "activation_aware": True,
            "awq": True, "calibration_text": ""}


@pytest.mark.parametrize("variant, split", [("8da8w", True), ("8da8w-one-row", False)])
def test_logits_within_bounds_of_fp32_and_of_quantized_eager(xnnpack_exports, tiny_calibration, variant, split):
    result = xnnpack_exports(variant)
    assert result.report["quantization"]["options"]["outlier_split"] is split
    linears = sum(isinstance(m, torch.nn.Linear) for m in fp32_tiny().modules())
    quantized = quantize_8da8w(fp32_tiny(), {**DEFAULTS, "outlier_split": split}, tiny_calibration)
    layers = [m for m in quantized.modules() if isinstance(m, ChannelInt8Linear)]
    assert len(layers) == linears and all(m.outlier_split is split for m in layers)
    vs_fp32, vs_quantized = worst_diffs(Program.load(result.pte), [fp32_tiny(), quantized])
    print(f"{variant}: max |logit diff| vs fp32 {vs_fp32:.4g}, vs quantized eager {vs_quantized:.4g}")
    assert vs_fp32 <= 0.03 and vs_quantized <= 0.01


def test_two_rows_are_delegated_like_one(xnnpack_exports):
    """The split adds operators inside the delegates, not delegates or portable operators."""
    two, one = (xnnpack_exports(v).report["delegation"] for v in ("8da8w", "8da8w-one-row"))
    assert two["delegated_subgraphs"] == one["delegated_subgraphs"]
    portable = lambda d: sorted(o["op_type"] for o in d["operators"] if o["not_delegated"])  # noqa: E731
    assert portable(two) == portable(one)


def test_defaults_are_the_recipes():
    import llmcore_xnnpack

    recipe = next(r for r in llmcore_xnnpack.llmcore_quantizers() if r.name == "8da8w")
    assert recipe.calibrated
    assert {key: default for key, (_, default, _) in recipe.options.items()} == DEFAULTS


def test_activation_aware_scales_are_calibrated_and_min_max_needs_no_text(tiny_calibration):
    """Scales chosen on the calibration text differ from min/max's on some channel; with
    ``activation_aware=false`` they are min/max's and no calibration is needed."""
    from llmcore_xnnpack import qlinear

    aware = quantize_8da8w(fp32_tiny(), DEFAULTS, tiny_calibration)
    plain = quantize_8da8w(fp32_tiny(), {**DEFAULTS, "activation_aware": False, "awq": False}, None)
    fp32 = dict(fp32_tiny().named_modules())
    differ = 0
    for name, layer in plain.named_modules():
        if isinstance(layer, ChannelInt8Linear):
            q, scales = qlinear.int8_channels(fp32[name].weight.detach())
            assert torch.equal(layer.scales, scales) and torch.equal(layer.q, q)
            differ += not torch.equal(aware.get_submodule(name).scales, layer.scales)
    assert differ > 0


def test_refuses_calibration_text_when_nothing_reads_it():
    from llmcore.errors import LlmcoreError

    model = fp32_tiny()
    with pytest.raises(LlmcoreError, match="8da8w: calibration_text is read only for activation-aware and channel scales"):
        quantize_8da8w(model, {**DEFAULTS, "activation_aware": False, "awq": False, "calibration_text": "notes.txt"})
    assert not any(isinstance(m, ChannelInt8Linear) for m in model.modules())


def test_refuses_unknown_embedding_bits_before_changing_a_layer():
    from llmcore.errors import LlmcoreError

    model = fp32_tiny()
    with pytest.raises(LlmcoreError, match="8da8w: embedding_bits 6"):
        quantize_8da8w(model, {**DEFAULTS, "embedding_bits": 6}, None)
    assert not any(isinstance(m, ChannelInt8Linear) for m in model.modules())
    assert all(type(m) is torch.nn.Embedding for m in model.modules() if isinstance(m, torch.nn.Embedding))
