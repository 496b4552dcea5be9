"""Channel scales (``awq``, the default of ``8da4w`` and ``8da8w``) on the tiny Llama, whose
model lists its foldable channels (norms into q/k/v and gate/up, values into the output
projection across grouped-query heads, up into down).

* the exported program against its eager twin (the pipeline's parity check) and the fp32
  model: the folds change no operator, only weights;
* a Llama whose norms have outlier channels, as trained LLMs do: with the scales its
  quantized logits are closer to the fp32 ones on a text the calibration never saw.
"""

from __future__ import annotations

import copy

import pytest
import torch

from llmcore.plugins import load_registry
from llmcore.recipe import ExportOptions
from llmcore.runtime import Program
from llmcore.testing.conformance import calibration_of, tiny_model
from llmcore_xnnpack.recipes import quantize_8da4w, quantize_8da8w


def defaults(recipe: str) -> dict:
    import llmcore_xnnpack

    record = next(r for r in llmcore_xnnpack.llmcore_quantizers() if r.name == recipe)
    return {key: default for key, (_, default, _) in record.options.items()}


def with_outlier_channels(model):
    """Four channels of every pre-norm 20x louder (trained LLMs' residual streams have a few)."""
    with torch.no_grad():
        for layer in model.layers:
            for norm in (layer.attention_norm, layer.ffn_norm):
                norm.weight[[3, 17, 40, 58]] *= 20.0
    return model


HELD_OUT = (
    "The lighthouse keeper counted the ships each evening and wrote their names in a ledger. "
    "When the fog rolled in, she lit the lamp early, wound the clockwork, and listened for horns. "
    "Her brother sent letters from the city about trains, markets and the price of coal; she "
    "answered with the tides, the gulls, and the number of storms since March: seventeen."
)


def held_out_error(loaded, quantized, fp32) -> float:
    """Squared logit difference over every prefix of a text the calibration never saw."""
    from llmcore.runtime.generate import TextTokenizer
    from llmcore.pipeline import text_ids

    ids = text_ids(TextTokenizer(loaded.tokenizer.json_text), HELD_OUT, loaded.metadata)[:120]
    tokens = torch.tensor([ids])
    total = 0.0
    for end in range(4, len(ids) + 1, 4):
        with torch.no_grad():
            total += float((quantized(tokens[:, :end]) - fp32(tokens[:, :end])).square().sum())
    return total


@pytest.mark.parametrize("recipe, quantize, bound", [("8da4w", quantize_8da4w, 0.8), ("8da8w", quantize_8da8w, 1.0)])
def test_scales_cut_the_error_of_a_llama_with_outlier_channels(recipe, quantize, bound):
    """Observed (held-out error with awq / without): 8da4w 0.71x; 8da8w 0.93x, whose two-row
    activations already take most of what outlier channels cost (on SmolLM2 the scales cut
    its mean KL from fp32 by a fifth: docs/quantization.md)."""
    loaded = tiny_model("llama")
    fp32 = with_outlier_channels(loaded.module.eval())
    calibration = calibration_of(loaded)
    options = defaults(recipe)
    assert options["awq"] is True
    scaled = quantize(copy.deepcopy(fp32), options, calibration)
    plain = quantize(copy.deepcopy(fp32), {**options, "awq": False}, calibration)
    ratio = held_out_error(loaded, scaled, fp32) / held_out_error(loaded, plain, fp32)
    print(f"{recipe}: held-out logit error with channel scales {ratio:.3f}x without")
    assert ratio < bound
    # the folds moved weights between layers: norms and value / up rows are not the fp32 ones
    assert not torch.equal(scaled.layers[0].attention_norm.weight, fp32.layers[0].attention_norm.weight)


def test_program_with_channel_scales_matches_its_eager_twin(tmp_path, caplog):
    from llmcore.pipeline import export

    out = tmp_path / "llama-8da4w.pte"
    options = ExportOptions(model="llama", config="tiny", output=str(out), quiet=True, plugins=["xnnpack"],
                            quantize="8da4w")
    with caplog.at_level("WARNING"):
        result = export(options, load_registry())
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("8da4w:")]
    assert summary and "channel scales on 8 groups" in summary[0]
    assert result.report["parity"]["max_abs_diff"] <= 0.02
    # and against the fp32 model: the scales are an identity in float arithmetic
    program = Program.load(str(out))
    fp32 = tiny_model("llama").module.eval()
    tokens = torch.randint(0, 320, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = fp32(tokens)[0]
    got = program.logits(tokens[0].tolist(), 0)
    assert (got - expected).abs().max() <= 0.2
    assert int(got.argmax()) == int(expected.argmax())
