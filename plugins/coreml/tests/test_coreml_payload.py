"""What the Core ML delegates of the tiny exports carry, read back with coremltools.

The pip wheel's runtime cannot run Core ML, and Linux cannot compile a Core ML model,
but coremltools opens the model package a delegate carries: its inputs, its state (the
KV cache) and the operations of its ML program.
"""

from __future__ import annotations

import pytest

from llmcore.testing.conformance import export_tiny, transformer_linear_layers
from llmcore_coreml.payload import extract_models, load_spec, mil_operations

CM = "CoreMLBackend"
LAYERS = 2  # both tiny configs


def _model(result, tmp_path):
    packages = extract_models(result.pte, tmp_path)
    assert len(packages) == 1, packages  # the whole model in one Core ML delegate
    return load_spec(packages[0])


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
def test_cache_program_is_one_core_ml_model_with_state_and_fused_sdpa(family, tmp_path):
    result = export_tiny("coreml", family, fallbacks=("xnnpack",))
    by_backend = result.report["delegation"]["by_backend"]
    assert list(by_backend) == [CM]  # nothing left for XNNPACK
    assert by_backend[CM]["operators"]["coreml_sdpa_default"] == LAYERS
    spec = _model(result, tmp_path)
    assert [i.name for i in spec.description.input] == ["tokens", "input_pos"]
    assert len(spec.description.state) == 2 * LAYERS  # k and v caches as Core ML state
    ops = mil_operations(spec)
    assert ops["scaled_dot_product_attention"] == LAYERS
    assert ops["write_state"] == 2 * LAYERS and ops["scatter_nd"] == 2 * LAYERS
    assert ops["linear"] >= transformer_linear_layers(family)


def test_no_cache_program_has_no_state(tmp_path):
    result = export_tiny("coreml", "llama", skip_transforms=["kv-cache"])
    spec = _model(result, tmp_path)
    assert [i.name for i in spec.description.input] == ["tokens"]
    assert len(spec.description.state) == 0
    assert mil_operations(spec)["scaled_dot_product_attention"] == LAYERS


def test_cache_outside_core_ml_when_asked(tmp_path):
    result = export_tiny("coreml", "nanogpt", backend_options={"cache_as_state": False})
    spec = _model(result, tmp_path)
    assert len(spec.description.state) == 0
    assert len(spec.description.input) == 2 + 2 * LAYERS  # tokens, input_pos, the caches


@pytest.mark.parametrize("recipe", ["coreml-8w", "coreml-4w"])
def test_weight_quantization_lowers_to_core_ml_int_weights(recipe, tmp_path):
    result = export_tiny("coreml", "llama", quantize=recipe)
    ops = mil_operations(_model(result, tmp_path))
    # Every linear layer (the tied output layer too) reads constexpr int weights; the other
    # linears are RoPE's pair swaps (q and k in each layer), exact and left in float.
    assert ops["constexpr_blockwise_shift_scale"] == transformer_linear_layers("llama") + 1
    assert ops["linear"] == transformer_linear_layers("llama") + 1 + 2 * LAYERS
    fp = export_tiny("coreml", "llama")
    assert result.report["outputs"]["pte_bytes"] < fp.report["outputs"]["pte_bytes"]


@pytest.mark.slow
def test_coreml_pt2e_quantizer_lowers(tmp_path):
    # Core ML's own CoreMLQuantizer: ~90 s of pattern tracing on two cores, whatever the model.
    result = export_tiny("coreml", "nanogpt", quantize="coreml-pt2e-8w")
    assert result.report["delegation"]["by_backend"][CM]["operators"][
        "quantized_decomposed_dequantize_per_channel_default"
    ] == transformer_linear_layers("nanogpt") + 1
    ops = mil_operations(_model(result, tmp_path))
    assert ops["constexpr_blockwise_shift_scale"] == ops["linear"]
