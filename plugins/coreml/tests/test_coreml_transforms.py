"""The coreml-attention transform computes what the original model computes (eager PyTorch).

Tolerances (fp32; the tiny models' logits span about +-1):
* CoreMLAttention vs CausalAttention on random q/k/v: max |diff| <= 1e-6 (observed 0:
  both are PyTorch's SDPA, one with is_causal, one with the finite mask);
* CoreMLKVAttention against CausalAttention recomputing the prefix: prefill of 16
  positions, then 8 single-token steps, max |diff| <= 1e-6;
* whole tiny models through the transforms `--plugins coreml` selects, at sequence
  lengths 1, 17, 128 (no cache) or a 16-token prefill and 8 decode steps (cache) against
  the original recomputing the prefix: max |diff| <= 1e-5 (observed <= 1.8e-7).
"""

from __future__ import annotations

import pytest
import torch

from llmcore.kv_cache import CustomOpKVAttention, StaticKVAttention
from llmcore.modules import CausalAttention
from llmcore.testing.conformance import diff_from_tiny, transformed_tiny
from llmcore.testing.equivalence import attention_diff
from llmcore_coreml.attention import CoreMLAttention, CoreMLKVAttention

MODEL_TOL = 1e-5
ATTENTION_TOL = 1e-6


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("seq_len", [1, 7, 32])
def test_coreml_attention_matches_causal_attention(heads, seq_len):
    n_heads, n_kv = heads
    assert attention_diff(CoreMLAttention(n_heads, n_kv, 16, max_seq_len=32), n_heads, n_kv, 16, seq_len) <= ATTENTION_TOL


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_coreml_cache_matches_full_recompute(heads):
    n_heads, n_kv = heads
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 24, n_heads, 16, generator=gen)
    k = torch.randn(1, 24, n_kv, 16, generator=gen)
    v = torch.randn(1, 24, n_kv, 16, generator=gen)
    cached = CoreMLKVAttention(n_heads, n_kv, 16, capacity=32)
    full = CausalAttention(n_heads, n_kv, 16)
    with torch.no_grad():
        got = [cached(q[:, :16], k[:, :16], v[:, :16], torch.tensor([0]))]
        got += [cached(q[:, p : p + 1], k[:, p : p + 1], v[:, p : p + 1], torch.tensor([p])) for p in range(16, 24)]
        want = full(q, k, v)
    assert float((torch.cat(got, dim=1) - want).abs().max()) <= ATTENTION_TOL


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
def test_cache_program_matches_original(family):
    module, context, applied = transformed_tiny(family, ["coreml"])
    assert applied == ["kv-cache", "coreml-attention"]
    assert context.use_kv_cache and not context.use_sdpa_with_kv_cache
    assert not any(isinstance(m, CustomOpKVAttention) for m in module.modules())
    assert any(isinstance(m, CoreMLKVAttention) for m in module.modules())
    diff = diff_from_tiny(module, family, use_kv_cache=True)
    assert diff <= MODEL_TOL, diff


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
def test_no_cache_program_matches_original(family):
    module, context, applied = transformed_tiny(family, ["coreml"], skip_transforms=["kv-cache"])
    assert applied == ["coreml-attention"] and not context.use_kv_cache
    assert any(isinstance(m, CoreMLAttention) for m in module.modules())
    diff = diff_from_tiny(module, family)
    assert diff <= MODEL_TOL, diff


def test_plain_pytorch_cache_is_left_to_core_ml():
    module, _context, applied = transformed_tiny("nanogpt", ["coreml"], transforms=["kv-cache-static"])
    assert applied == ["kv-cache-static", "coreml-attention"]
    assert any(isinstance(m, StaticKVAttention) for m in module.modules())


def test_transform_runs_only_when_coreml_is_selected():
    _module, _context, applied = transformed_tiny("nanogpt", ["xnnpack"])
    assert applied == ["split-qkv", "xnnpack-norms", "kv-cache"]
