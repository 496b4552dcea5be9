"""xnnpack-norms: the pool-mean norms compute what the plain ones do, and run only when
XNNPACK gets the graph first."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmcore.modules import LayerNorm, RMSNorm
from llmcore.testing.conformance import transformed_tiny
from llmcore_xnnpack.norms import PoolMeanLayerNorm, PoolMeanRMSNorm, use_pool_mean_norms


@pytest.mark.parametrize("shape", [(5, 48), (2, 7, 48), (1, 1, 48)])
def test_pool_mean_norms_match_the_plain_ones(shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-2, 2, shape[-1]) + 3.0  # off-centre, uneven scales
    rms, ln = RMSNorm(48, eps=1e-6), LayerNorm(48, bias=True)
    with torch.no_grad():
        for p in (rms.weight, ln.weight, ln.bias):
            p.normal_()
    expected_rms, expected_ln = rms(x), F.layer_norm(x, (48,), ln.weight, ln.bias, 1e-5)
    model = torch.nn.ModuleList([rms, ln])
    assert use_pool_mean_norms(model) == 2
    assert type(rms) is PoolMeanRMSNorm and type(ln) is PoolMeanLayerNorm
    torch.testing.assert_close(rms(x), expected_rms, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ln(x), expected_ln, atol=1e-5, rtol=1e-5)
    assert use_pool_mean_norms(model) == 0  # already switched


@pytest.mark.parametrize("family", ["llama", "nanogpt"])
def test_only_when_xnnpack_comes_first(family):
    module, _context, applied = transformed_tiny(family, ["xnnpack"])
    assert "xnnpack-norms" in applied
    assert not any(type(m) in (RMSNorm, LayerNorm) for m in module.modules())
    pytest.importorskip("llmcore_vulkan")  # any backend that can come first
    module, _context, applied = transformed_tiny(family, ["vulkan", "xnnpack"])
    assert "xnnpack-norms" not in applied and "split-qkv" not in applied
    assert any(type(m) in (RMSNorm, LayerNorm) for m in module.modules())
