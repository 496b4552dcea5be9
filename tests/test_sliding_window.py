"""Attention beyond plain causal SDPA: sliding windows, another scale, soft-capped scores
(``CausalAttention(window=, scale=, softcap=)``) against softmax attention written out with
einsum, and both KV-cache transforms against it while decoding past the window."""

from __future__ import annotations

import math

import pytest
import torch

from llmcore.builtins.kv_cache import CustomOpKVAttention, StaticKVAttention
from llmcore.errors import LlmcoreError
from llmcore.modules import CausalAttention, unusual_attention

H, KV, D = 4, 2, 8


def qkv(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, t, h, D, generator=g) for h in (H, KV, KV))


def reference(q, k, v, window, scale=None, softcap=None):
    """Softmax attention written out: query i sees keys j with i - window < j <= i; scores
    times ``scale`` (default 1/sqrt(D)), then ``softcap * tanh(scores / softcap)``."""
    t = q.shape[1]
    k, v = k.repeat_interleave(H // KV, dim=2), v.repeat_interleave(H // KV, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * (scale if scale is not None else 1 / math.sqrt(D))
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i, j = torch.arange(t).unsqueeze(1), torch.arange(t).unsqueeze(0)
    visible = (j <= i) & (i - j < window if window else True)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bjhd->bihd", weights, v).reshape(1, t, H * D)


@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_causal_attention_window_matches_the_definition(window):
    q, k, v = qkv(20)
    got = CausalAttention(H, KV, D, window)(q, k, v)
    torch.testing.assert_close(got, reference(q, k, v, window), atol=1e-5, rtol=0)


# (scale, softcap): Gemma 2's forms; scores of these random inputs reach ~±8, so a cap of 2
# changes them and any mistake in where it is applied shows
SCORINGS = [(None, None), (0.7, None), (None, 2.0), (0.7, 2.0)]
SCORING_IDS = ["plain", "scale", "softcap", "scale+softcap"]


@pytest.mark.parametrize("scale, softcap", SCORINGS, ids=SCORING_IDS)
@pytest.mark.parametrize("window", [None, 5])
def test_scale_and_softcap_match_the_definition(window, scale, softcap):
    q, k, v = qkv(20, seed=2)
    got = CausalAttention(H, KV, D, window, scale=scale, softcap=softcap)(q, k, v)
    torch.testing.assert_close(got, reference(q, k, v, window, scale, softcap), atol=1e-5, rtol=0)
    if softcap is not None:  # the cap is not a no-op on these inputs
        assert (got - reference(q, k, v, window, scale)).abs().max() > 1e-2


@pytest.mark.parametrize("scale, softcap", SCORINGS, ids=SCORING_IDS)
@pytest.mark.parametrize(
    "cache, plain, capped_kernel",
    [(CustomOpKVAttention, False, True), (CustomOpKVAttention, False, False), (CustomOpKVAttention, True, True),
     (StaticKVAttention, False, True)],
    ids=["custom-ops", "custom-ops-caps-written-out", "custom-ops-plain-attention", "plain-pytorch"],
)
@pytest.mark.parametrize("window, slots", [(None, None), (5, None), (5, 9)], ids=["full", "window", "ring"])
def test_caches_keep_the_window_while_decoding_past_it(monkeypatch, cache, plain, capped_kernel, window, slots, scale,
                                                       softcap):
    """A 7-token prefill (two chunks of at most 5 into a ring buffer of 9 rows), then 17
    single-token steps: every step's output equals attention over the whole sequence (with
    the window, well past it, and past the ring's length), at the layer's scale and cap.
    ``plain``: the custom-op cache as the export's parity reference runs it (plain_attention).
    ``capped_kernel``: soft caps through llmcore::softcap_sdpa, or (its library not built)
    written out."""
    import contextlib
    import importlib

    from llmcore.builtins import runtime_attention
    from llmcore.builtins.kv_cache import CUSTOM_OPS_MODULE, plain_attention

    importlib.import_module(CUSTOM_OPS_MODULE)
    monkeypatch.setattr(runtime_attention, "kernel_built", lambda: capped_kernel)
    with plain_attention() if plain else contextlib.nullcontext():
        attn = _decode_past_the_window(cache, window, slots, scale, softcap)
    if cache is CustomOpKVAttention:
        assert attn.capped_kernel == (capped_kernel and softcap is not None)


def _decode_past_the_window(cache, window, slots, scale, softcap):
    total, prefill = 24, 7
    q, k, v = qkv(total, seed=1)
    want = reference(q, k, v, window, scale, softcap)
    attn = cache(H, KV, D, capacity=32, window=window, scale=scale, softcap=softcap, slots=slots)
    assert attn.k_cache.shape[-3] == (slots or 32)
    chunks = [(0, 5), (5, prefill)] if slots else [(0, prefill)]
    got = [attn(q[:, a:b], k[:, a:b], v[:, a:b], torch.tensor([a])) for a, b in chunks]
    for pos in range(prefill, total):
        s = slice(pos, pos + 1)
        got.append(attn(q[:, s], k[:, s], v[:, s], torch.tensor([pos])))
    torch.testing.assert_close(torch.cat(got, dim=1), want, atol=1e-5, rtol=0)
    return attn


def test_a_window_no_shorter_than_the_cache_is_plain_causal_attention():
    assert CustomOpKVAttention(H, KV, D, capacity=16, window=16).window is None
    assert StaticKVAttention(H, KV, D, capacity=16, window=8).window == 8


@pytest.mark.parametrize("attention, what", [
    (CausalAttention(H, KV, D, window=4), "sliding-window"),
    (CausalAttention(H, KV, D, softcap=50.0), "soft-capped"),
    (CausalAttention(H, KV, D, scale=0.1), "scale"),
], ids=["window", "softcap", "scale"])
def test_backend_attention_forms_refuse_what_they_do_not_implement(attention, what):
    """Backends that replace attention with their own form name themselves, the layer, what
    it does and the fix."""
    model = torch.nn.Sequential(attention)
    assert [name for name, _ in unusual_attention(model)] == ["0"]
    assert unusual_attention(torch.nn.Sequential(CausalAttention(H, KV, D))) == []

    class Context:
        max_seq_len = 16
        use_sdpa_with_kv_cache = False

    checked = 0
    for module, fn, plugin in (("llmcore_vulkan.attention", "apply", "vulkan"),
                               ("llmcore_qnn.transforms", "single_head_attention", "qnn"),
                               ("llmcore_coreml.attention", "apply", "coreml")):
        try:
            transform = getattr(__import__(module, fromlist=[fn]), fn)
        except ImportError:
            continue
        with pytest.raises(LlmcoreError) as e:
            transform(model, Context())
        assert e.value.plugin == plugin and what in str(e.value) and " 0 uses " in str(e.value) and e.value.fix
        checked += 1
    if checked == 0:
        pytest.skip("no backend plugin with its own attention form is installed")


def test_the_mask_is_computed_once_per_forward_for_all_layers():
    """Per layer, the exported program kept one [T, capacity] mask per sliding layer in its
    planned memory; the transform computes each window's mask once, before the layers."""
    from types import SimpleNamespace

    from llmcore import kv_cache
    from llmcore.builtins.kv_cache import _apply

    class TwoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, H * D)
            self.layers = torch.nn.ModuleList(CausalAttention(H, KV, D, window=3) for _ in range(2))

        def forward(self, tokens, input_pos):
            x = self.emb(tokens).view(1, -1, H, D)
            for layer in self.layers:
                x = layer(x, x[:, :, :KV], x[:, :, :KV], input_pos).view(1, -1, H, D)
            return x.sum()

    transformed = _apply(TwoLayers(), SimpleNamespace(max_seq_len=8, kv_cache_dtype="fp32"), kv_cache.CUSTOM_OPS)
    model, convention = transformed.module, transformed.convention
    assert convention.max_tokens_per_call == 3 and model.layers[0].k_cache.shape[1] == 5  # ring buffers of 3 + 3 - 1
    assert convention.use_kv_cache and convention.use_sdpa_with_kv_cache
    tokens, pos = torch.tensor([[1, 2, 3]]), torch.tensor([0])
    eager = model(tokens, pos)
    program = torch.export.export(model, (tokens, pos))
    fills = [n for n in program.graph.nodes if n.op == "call_function" and "masked_fill" in str(n.target)]
    sdpa = [n for n in program.graph.nodes if n.op == "call_function" and "custom_sdpa" in str(n.target)]
    assert len(fills) == 1 and len(sdpa) == 2, program.graph
    torch.testing.assert_close(program.module()(tokens, pos), eager)  # rewriting positions 0..2: same result
