"""The mps-static-length transform computes what the original model computes (eager PyTorch).

Tolerances (fp32; the tiny models' logits span about +-1):
* StaticMaskAttention vs CausalAttention over the full static length: max |diff| <= 1e-6;
* whole tiny models (padded to 128 positions) against the original at sequence lengths
  1, 17, 64 and 128: max |diff| <= 1e-5 (observed <= 2.4e-7).
"""

from __future__ import annotations

import pytest
import torch

from llmcore.errors import LlmcoreError
from llmcore.testing.conformance import diff_from_tiny, tiny_model, transformed_tiny
from llmcore.testing.equivalence import attention_diff

# ExecuTorch 1.5 removed MPS: there llmcore-mps refuses to import (and the main env does
# not install it), so this module skips; `make test-mps` runs it on executorch 1.4.1.
pytest.importorskip("llmcore_mps", exc_type=ImportError)

from llmcore_mps.static import MASK_VALUE, StaticLength, StaticMaskAttention, static_length  # noqa: E402

MODEL_TOL = 1e-5
ATTENTION_TOL = 1e-6


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_static_mask_attention_matches_causal_attention(heads):
    n_heads, n_kv = heads
    attn = StaticMaskAttention(n_heads, n_kv, 16, length=32)
    assert attention_diff(attn, n_heads, n_kv, 16, 32) <= ATTENTION_TOL
    assert attn.mask.dtype == torch.float32 and torch.isfinite(attn.mask.half()).all()
    assert float(attn.mask.min()) == MASK_VALUE


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
def test_static_length_program_matches_original(family):
    module, context, applied = transformed_tiny(family, ["mps"])
    assert applied == ["mps-static-length"]  # kv-cache is replaced: MPS programs have no cache
    assert not context.use_kv_cache
    assert isinstance(module, StaticLength) and module.length == 128
    diff = diff_from_tiny(module, family, lengths=(1, 17, 64, 128))
    assert diff <= MODEL_TOL, diff


def test_shorter_program_length(family="llama"):
    module, _context, _applied = transformed_tiny(family, ["mps"], max_seq_len=32)
    assert module.length == 32
    diff = diff_from_tiny(module, family, lengths=(1, 9, 32))
    assert diff <= MODEL_TOL, diff


def test_plain_pytorch_cache_is_refused_with_a_fix():
    with pytest.raises(LlmcoreError) as info:
        transformed_tiny("nanogpt", ["mps"], transforms=["kv-cache-static"])
    assert "no KV cache" in info.value.message and "kv-cache-static" in info.value.fix


def test_unknown_family_is_refused_with_a_fix():
    with pytest.raises(LlmcoreError) as info:
        static_length(tiny_model("nanogpt").module, "mystery", 16)
    assert "mystery" in info.value.message and "coreml" in info.value.fix


def test_transform_runs_only_when_mps_is_selected():
    _module, context, applied = transformed_tiny("nanogpt", ["xnnpack"])
    assert applied == ["split-qkv", "xnnpack-norms", "kv-cache"] and context.use_kv_cache
