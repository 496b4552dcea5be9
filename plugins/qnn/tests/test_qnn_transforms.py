"""The QNN source transforms compute what the original model computes (eager PyTorch, fp32).

Tolerances (logits of the tiny models span about +-1):
* SingleHeadAttention vs CausalAttention on random q/k/v: max |diff| <= 1e-6;
* Conv2dLinear vs nn.Linear on random inputs: max |diff| <= 1e-5 (conv2d and linear sum
  in different orders; observed ~1e-6);
* whole tiny models through every transform ``--plugins qnn`` selects, at sequence
  lengths 1, 17 and 128 (no cache), or a 16-token prefill and 8 decode steps (cached)
  against the original recomputing the prefix: max |diff| <= 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmcore.kv_cache import CustomOpKVAttention, StaticKVAttention
from llmcore.modules import CausalAttention
from llmcore.testing.conformance import diff_from_tiny, tiny_model, transformed_tiny
from llmcore.testing.equivalence import attention_diff
from llmcore_qnn.transforms import (
    MASK_VALUE,
    Conv2dLinear,
    SingleHeadAttention,
    SingleHeadStaticKVAttention,
    linear_to_conv2d,
)

ATTENTION_TOL = 1e-6
LINEAR_TOL = 1e-5
MODEL_TOL = 1e-5
QNN_TRANSFORMS = ["qnn-single-head-attention", "qnn-linear-to-conv2d"]


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("seq_len", [1, 7, 32])
def test_single_head_attention_matches_causal_attention(heads, seq_len):
    n_heads, n_kv = heads
    attn = SingleHeadAttention(n_heads, n_kv, 16, max_seq_len=32)
    assert attention_diff(attn, n_heads, n_kv, 16, seq_len) <= ATTENTION_TOL


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_single_head_cache_matches_static_cache(heads):
    n_heads, n_kv = heads
    gen = torch.Generator().manual_seed(0)
    ref, new = StaticKVAttention(n_heads, n_kv, 8, 32), SingleHeadStaticKVAttention(n_heads, n_kv, 8, 32)
    worst = 0.0
    for start, length in [(0, 5), (5, 1), (6, 1), (7, 3)]:
        q = torch.randn(1, length, n_heads, 8, generator=gen)
        k, v = (torch.randn(1, length, n_kv, 8, generator=gen) for _ in range(2))
        pos = torch.tensor([start])
        with torch.no_grad():
            worst = max(worst, float((new(q, k, v, pos) - ref(q, k, v, pos)).abs().max()))
    assert worst <= ATTENTION_TOL, worst
    assert torch.equal(new.k_cache, ref.k_cache) and torch.equal(new.v_cache, ref.v_cache)


def test_mask_is_finite_and_fp16_safe():
    attn = SingleHeadAttention(2, 2, 8, max_seq_len=8)
    assert attn.mask.shape == (8, 9) and torch.isfinite(attn.mask.half()).all()
    assert float(attn.mask.min()) == MASK_VALUE and (attn.mask.tril() == 0).all()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 24), (1, 13, 24), (3, 24)])
def test_conv2d_linear_matches_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        diff = (Conv2dLinear(linear)(x) - linear(x)).abs().max()
    assert diff <= LINEAR_TOL, float(diff)


def test_linear_to_conv2d_keeps_parameters_and_ties():
    module = tiny_model("nanogpt").module
    tied_before = {n for n, p in module.named_parameters()}
    linear_to_conv2d(module)
    assert not any(type(m) is nn.Linear for m in module.modules())
    assert any(isinstance(m, Conv2dLinear) for m in module.modules())
    # nanoGPT ties lm_head to the token embedding: still one Parameter, same names
    assert {n for n, p in module.named_parameters()} == tied_before
    heads = [m for m in module.modules() if isinstance(m, Conv2dLinear) and m.out_features == 257]
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding) and m.num_embeddings == 257]
    assert heads and embeddings and heads[0].weight is embeddings[0].weight


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
def test_no_cache_program_matches_original(family):
    module, context, applied = transformed_tiny(family, ["qnn"], skip_transforms=["kv-cache"])
    assert applied == QNN_TRANSFORMS and not context.use_kv_cache
    assert not any(isinstance(m, (CausalAttention, nn.Linear)) and type(m) in (CausalAttention, nn.Linear)
                   for m in module.modules())
    assert any(isinstance(m, SingleHeadAttention) for m in module.modules())
    diff = diff_from_tiny(module, family)
    assert diff <= MODEL_TOL, diff


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
@pytest.mark.parametrize("extra", [[], ["kv-cache-static"]])
def test_cached_program_matches_original(family, extra):
    module, context, applied = transformed_tiny(family, ["qnn"], transforms=extra, max_seq_len=64)
    assert applied == [extra[0] if extra else "kv-cache", *QNN_TRANSFORMS]
    assert context.use_kv_cache and not context.use_sdpa_with_kv_cache
    assert not any(isinstance(m, (CustomOpKVAttention, StaticKVAttention)) for m in module.modules())
    assert any(isinstance(m, SingleHeadStaticKVAttention) for m in module.modules())
    diff = diff_from_tiny(module, family, use_kv_cache=True)
    assert diff <= MODEL_TOL, diff


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
def test_transformed_models_export_with_dynamic_seq_len(family):
    from llmcore.pipeline import capture

    for skip in (["kv-cache"], []):
        module, context, _ = transformed_tiny(family, ["qnn"], skip_transforms=skip, max_seq_len=64)
        inputs = capture.example_inputs([1, 2, 3, 4], context.use_kv_cache)
        ep = capture.capture(module, inputs, 64, context.use_kv_cache, family=family)
        targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert "aten.conv2d.default" in targets and "aten.linear.default" not in targets
        assert "aten.scaled_dot_product_attention.default" not in targets


def test_transforms_apply_only_with_qnn():
    _, _, applied = transformed_tiny("nanogpt", [])
    assert not set(applied) & set(QNN_TRANSFORMS)
