"""``xnnpack-norms``: RMSNorm and LayerNorm written so XNNPACK takes them whole.

XNNPACK lowers ``mean`` only over the two inner dims of a 4-D tensor (a global average
pool) and has no ``layer_norm``. A norm over the last dim of ``[B, T, C]`` therefore leaves
its ``mean`` (or the whole ``layer_norm``) to the portable runtime, which splits every
transformer layer into several delegates with the activations written out in between,
and lowering takes far longer (docs/performance.md, "Measurements behind the code").

The same arithmetic over a ``[N, 1, 1, C]`` view is a global average pool, so the norms
here compute exactly what :class:`llmcore.modules.RMSNorm` and
:class:`llmcore.modules.LayerNorm` compute, in ops XNNPACK delegates. The swap changes the
class of each norm in place (same parameters, no copies), and only when XNNPACK is the
first backend: a GPU backend listed first has its own fused norm kernels and is better
served by the plain form.
"""

from __future__ import annotations

import torch
from torch import nn

from llmcore.modules import LayerNorm, RMSNorm, static_shape

TRANSFORM = "xnnpack-norms"


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, 1, 1, C]``: a mean over dims (2, 3) is then XNNPACK's global pool."""
    return x.reshape(-1, 1, 1, x.shape[-1])


class PoolMeanRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x4 = _rows(x.float())
        x4 = x4 * torch.rsqrt((x4 * x4).mean((2, 3), keepdim=True) + self.eps)
        return x4.view(static_shape(x)).type_as(x) * self.weight


class PoolMeanLayerNorm(LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x4 = _rows(x)
        centred = x4 - x4.mean((2, 3), keepdim=True)
        var = (centred * centred).mean((2, 3), keepdim=True)
        y = (centred * torch.rsqrt(var + self.eps)).view(static_shape(x)) * self.weight
        return y + self.bias if self.bias is not None else y


_FORMS = {RMSNorm: PoolMeanRMSNorm, LayerNorm: PoolMeanLayerNorm}


def use_pool_mean_norms(module: nn.Module) -> int:
    """Switch every plain :class:`RMSNorm` / :class:`LayerNorm` in ``module`` to its
    pool-mean form; returns how many were switched."""
    count = 0
    for child in module.modules():
        form = _FORMS.get(type(child))
        if form is not None:
            child.__class__ = form
            count += 1
    return count


def apply(module: nn.Module, context) -> nn.Module:
    use_pool_mean_norms(module)
    return module
