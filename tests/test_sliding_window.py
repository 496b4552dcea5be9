"""Sliding-window attention: ``CausalAttention(window=W)`` against an explicit softmax,
and both KV-cache transforms against it while decoding past the window."""

from __future__ import annotations

import math

import pytest
import torch

from llmcore.builtins.kv_cache import CustomOpKVAttention, StaticKVAttention
from llmcore.errors import LlmcoreError
from llmcore.modules import CausalAttention, windowed_attention

H, KV, D = 4, 2, 8


def qkv(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, t, h, D, generator=g) for h in (H, KV, KV))


def reference(q, k, v, window):
    """Softmax attention written out: query i sees keys j with i - window < j <= i."""
    t = q.shape[1]
    k, v = k.repeat_interleave(H // KV, dim=2), v.repeat_interleave(H // KV, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D)
    i, j = torch.arange(t).unsqueeze(1), torch.arange(t).unsqueeze(0)
    visible = (j <= i) & (i - j < window if window else True)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bjhd->bihd", weights, v).reshape(1, t, H * D)


@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_causal_attention_window_matches_the_definition(window):
    q, k, v = qkv(20)
    got = CausalAttention(H, KV, D, window)(q, k, v)
    torch.testing.assert_close(got, reference(q, k, v, window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("cache", [CustomOpKVAttention, StaticKVAttention], ids=["custom-ops", "plain-pytorch"])
def test_caches_keep_the_window_while_decoding_past_it(cache):
    """A 7-token prefill, then 17 single-token steps: every step's output equals
    attention over the whole sequence with the window, well past the window (5)."""
    import importlib

    from llmcore.builtins.kv_cache import CUSTOM_OPS_MODULE

    importlib.import_module(CUSTOM_OPS_MODULE)
    window, total, prefill = 5, 24, 7
    q, k, v = qkv(total, seed=1)
    want = reference(q, k, v, window)
    attn = cache(H, KV, D, capacity=32, window=window)
    got = [attn(q[:, :prefill], k[:, :prefill], v[:, :prefill], torch.tensor([0]))]
    for pos in range(prefill, total):
        s = slice(pos, pos + 1)
        got.append(attn(q[:, s], k[:, s], v[:, s], torch.tensor([pos])))
    torch.testing.assert_close(torch.cat(got, dim=1), want, atol=1e-5, rtol=0)


def test_a_window_no_shorter_than_the_cache_is_plain_causal_attention():
    assert CustomOpKVAttention(H, KV, D, capacity=16, window=16).window is None
    assert StaticKVAttention(H, KV, D, capacity=16, window=8).window == 8


def test_backend_attention_forms_refuse_windows():
    """Backends that replace attention with their own form name themselves and the fix."""
    model = torch.nn.Sequential(CausalAttention(H, KV, D, window=4))
    assert windowed_attention(model) == ["0"]

    class Context:
        max_seq_len = 16
        use_sdpa_with_kv_cache = False
        runtime_imports: list = []

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
        assert e.value.plugin == plugin and "sliding-window" in str(e.value) and e.value.fix
        checked += 1
    if checked == 0:
        pytest.skip("no backend plugin with its own attention form is installed")


def test_the_mask_is_computed_once_per_forward_for_all_layers():
    """Per layer, the exported program kept one [T, capacity] mask per sliding layer in its
    planned memory; the transform computes each window's mask once, before the layers."""
    from types import SimpleNamespace

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

    context = SimpleNamespace(max_seq_len=8, use_kv_cache=False, use_sdpa_with_kv_cache=False, runtime_imports=[])
    model = _apply(TwoLayers(), context, CustomOpKVAttention, uses_custom_ops=True)
    tokens, pos = torch.tensor([[1, 2, 3, 4]]), torch.tensor([0])
    eager = model(tokens, pos)
    program = torch.export.export(model, (tokens, pos))
    fills = [n for n in program.graph.nodes if n.op == "call_function" and "masked_fill" in str(n.target)]
    sdpa = [n for n in program.graph.nodes if n.op == "call_function" and "custom_sdpa" in str(n.target)]
    assert len(fills) == 1 and len(sdpa) == 2, program.graph
    torch.testing.assert_close(program.module()(tokens, pos), eager)  # rewriting positions 0..3: same result
