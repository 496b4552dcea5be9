"""The vulkan-attention transform computes what the original model computes (eager PyTorch).

Tolerances (fp32, logits of the tiny models span about +-1):
* FiniteMaskAttention vs CausalAttention on random q/k/v: max |diff| <= 1e-6
  (observed ~2e-7);
* whole tiny models through the transforms `--plugins vulkan` selects, at sequence
  lengths 1, 17 and 128 (no cache), or a 16-token prefill and 8 decode steps (default
  cache) against the original recomputing the prefix: max |diff| <= 1e-5 (observed
  <= 2.4e-7).
"""

from __future__ import annotations

import pytest
import torch

from llmcore.errors import LlmcoreError
from llmcore.modules import CausalAttention
from llmcore.testing.conformance import diff_from_tiny, transformed_tiny
from llmcore.testing.equivalence import attention_diff
from llmcore_vulkan.attention import MASK_VALUE, FiniteMaskAttention

MODEL_TOL = 1e-5
ATTENTION_TOL = 1e-6


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("seq_len", [1, 7, 32])
def test_finite_mask_attention_matches_causal_attention(heads, seq_len):
    n_heads, n_kv = heads
    attn = FiniteMaskAttention(n_heads, n_kv, 16, max_seq_len=32)
    assert attention_diff(attn, n_heads, n_kv, 16, seq_len) <= ATTENTION_TOL


def test_mask_is_finite_and_fp16_safe():
    attn = FiniteMaskAttention(4, 4, 16, max_seq_len=8)
    assert torch.isfinite(attn.mask).all() and attn.mask.dtype == torch.float32
    assert attn.mask.shape == (8, 9)  # one spare column: the [:T, :T] slice never takes a whole row
    assert float(attn.mask.min()) == MASK_VALUE and torch.isfinite(attn.mask.half()).all()
    assert (attn.mask.tril() == 0).all()


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
def test_no_cache_program_matches_original(family):
    module, context, applied = transformed_tiny(family, ["vulkan"], skip_transforms=["kv-cache"])
    assert applied == ["vulkan-attention"] and not context.use_kv_cache
    assert not any(isinstance(m, CausalAttention) for m in module.modules())
    assert any(isinstance(m, FiniteMaskAttention) for m in module.modules())
    diff = diff_from_tiny(module, family)
    assert diff <= MODEL_TOL, diff


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
def test_default_cache_is_kept_and_matches_original(family):
    # Vulkan implements llama::update_cache and llama::custom_sdpa: the transform leaves them.
    from llmcore.kv_cache import CustomOpKVAttention

    module, context, applied = transformed_tiny(family, ["vulkan"])
    assert applied == ["kv-cache", "vulkan-attention"]
    assert context.use_kv_cache and context.use_sdpa_with_kv_cache
    assert any(isinstance(m, CustomOpKVAttention) for m in module.modules())
    assert not any(isinstance(m, FiniteMaskAttention) for m in module.modules())
    diff = diff_from_tiny(module, family, use_kv_cache=True)
    assert diff <= MODEL_TOL, diff


def test_plain_pytorch_cache_is_refused_with_a_fix():
    with pytest.raises(LlmcoreError) as info:
        transformed_tiny("nanogpt", ["vulkan"], transforms=["kv-cache-static"])
    assert "kv-cache-static" in info.value.message and "Vulkan" in info.value.message
    assert "--skip-transforms kv-cache" in info.value.fix


def test_transform_runs_only_when_vulkan_is_selected():
    _module, _context, applied = transformed_tiny("nanogpt", ["xnnpack"], skip_transforms=["kv-cache"])
    assert "vulkan-attention" not in applied
