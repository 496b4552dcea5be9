"""Channel scales (llmcore.channel_scales): the folds a model lists leave its float logits as
they were, a fold the arithmetic does not allow is refused, and the searched scales cut the
output error of a rounded layer whose inputs have outlier channels (held-out inputs)."""

from __future__ import annotations

import copy

import pytest
import torch

from llmcore import channel_scales
from llmcore.errors import LlmcoreError
from llmcore.records import ScalableChannels
from llmcore.testing.conformance import calibration_of, tiny_model


def int4_rounded(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int4 per block of 32, min/max scales: a backend's rounding, for the search."""
    blocks = w.reshape(w.shape[0], -1, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 7.5).clamp(min=1e-12)
    return (torch.round(blocks / d).clamp(-8, 7) * d).reshape(w.shape)


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


def test_llama_lists_every_layer_and_grouped_query_attention():
    model = tiny_model("llama").module
    groups = channel_scales.scalable_channels(model)
    assert len(groups) == 4 * len(model.layers)
    values = [g for g in groups if g.source.endswith("attention.wv")]
    # the tiny config: 4 heads reading 2 kv heads of 16 channels
    assert {(g.repeats, g.head_dim) for g in values} == {(2, 16)}


def test_listed_folds_leave_the_float_logits_unchanged():
    """Random scales (0.25x-4x) on every listed group: the same logits to float rounding."""
    model = tiny_model("llama").module.eval()
    tokens = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(0))
    before = logits(model, tokens)
    gen = torch.Generator().manual_seed(1)
    for group in channel_scales.scalable_channels(model):
        channels = model.get_submodule(group.source).weight.shape[0]
        channel_scales.fold(model, group, torch.exp(torch.empty(channels).uniform_(-1.4, 1.4, generator=gen)))
    after = logits(model, tokens)
    assert (after - before).abs().max() <= 1e-4 * before.abs().max()


def test_a_fold_the_arithmetic_does_not_allow_fails_the_export_step():
    """A model listing the attention norm as feeding only wq (k and v read it too) is caught by
    the logit check after folding, in one line that names the way out."""
    loaded = tiny_model("llama")
    model = loaded.module.eval()
    with torch.no_grad():
        model.layers[0].attention_norm.weight[:4] *= 30  # outlier channels: scales far from 1
    wrong = [ScalableChannels("layers.0.attention_norm", ("layers.0.attention.wq",))]
    search = channel_scales.ScaleSearch(model, wrong, lambda _, w: int4_rounded(w), lambda x: x, alphas=(1.0,))
    cal = calibration_of(loaded)
    tokens = cal.token_ids("")
    hook = model.layers[0].attention.wq.register_forward_pre_hook(
        lambda _, args: search.record("layers.0.attention.wq", args[0].reshape(-1, args[0].shape[-1])))
    cal.run(model, tokens)
    hook.remove()
    with pytest.raises(LlmcoreError) as info:
        search.fold(cal)
    assert "does not allow" in info.value.message and "awq=false" in info.value.fix
    assert info.value.stage == "quantize"


def test_listed_shapes_are_checked_before_anything_is_searched():
    model = tiny_model("llama").module
    wrong = [ScalableChannels("layers.0.ffn_norm", ("layers.0.feed_forward.w2",))]  # w2 reads 192 channels
    with pytest.raises(LlmcoreError, match="lists layers.0.feed_forward.w2 as reading the 64 channels"):
        channel_scales.ScaleSearch(model, wrong, lambda _, w: w, lambda x: x)


def test_searched_scales_cut_the_output_error_on_held_out_inputs():
    """A linear whose inputs have four channels 20x larger than the rest, rounded to int4 per
    32 with int8 activations per token: the chosen scales give less output error than none on
    inputs the search never saw (observed 0.585x; bound 0.7x), and the search never picks
    worse than no scaling on what it saw."""
    gen = torch.Generator().manual_seed(0)
    loud = torch.ones(128)
    loud[[3, 40, 77, 100]] = 20.0

    def inputs(n):
        return torch.randn(n, 128, generator=gen) * loud

    w = torch.randn(96, 128, generator=gen) * 0.05
    group = ScalableChannels("norm", ("linear",))

    def per_token_int8(x):
        d = x.abs().amax(-1, keepdim=True) / 127
        return torch.round(x / d) * d

    seen, held_out = inputs(128), inputs(512)
    alpha, s, err, plain = channel_scales.choose_scales(group, seen, [w], lambda _, v: int4_rounded(v),
                                                        per_token_int8)
    assert alpha > 0 and err <= plain

    def output_error(scales):
        y = held_out @ w.T
        approx = per_token_int8(held_out / scales) @ int4_rounded(w * scales).T
        return float((y - approx).square().sum())

    ratio = output_error(s) / output_error(torch.ones(128))
    print(f"alpha {alpha}: held-out output error {ratio:.3f}x no scaling")
    assert ratio < 0.7


def test_models_that_list_nothing_get_no_groups():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert channel_scales.scalable_channels(model) == []
    assert channel_scales.scalable_channels(copy.deepcopy(tiny_model("llama").module))
