"""The ``fused-rmsnorm`` source transform: RMSNorm modules -> ``llmcore::rms_norm``.

The Llama family's ``RMSNorm`` computes ``(x * rsqrt(mean(x**2, -1) + eps)) * weight``
(``x`` in float32, rounded back to its dtype before the weight), which ``torch.export``
records as pow, mean, add, rsqrt and two muls. This transform swaps every module that
computes exactly that for :class:`FusedRMSNorm`, one call of the fused kernel, keeping the
same weight parameter.

A module qualifies when its class is named ``*RMSNorm``, it has a 1-D floating ``weight``
and a float ``eps`` (or ``variance_epsilon``), and, on a random input, it gives what the
kernel gives (within rounding). Modules that fail the check are left alone, so a norm with
other semantics (Gemma's ``1 + weight``, say) is never changed silently.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from llmcore.errors import LlmcoreError
from llmcore.records import TransformContext

TRANSFORM = "fused-rmsnorm"

# Largest difference allowed between a module and the kernel in the swap check (the sum of
# squares is accumulated in a different order), per dtype: (atol, rtol).
_CHECK_TOLERANCE = {
    torch.float32: (1e-5, 1e-4),
    torch.float64: (1e-5, 1e-4),  # the module computes in float32 either way
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 2e-2),
}


class FusedRMSNorm(nn.Module):
    """RMSNorm through ``llmcore::rms_norm``; shares the weight of the module it replaces."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llmcore.rms_norm.default(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _eps(module: nn.Module) -> Optional[float]:
    for attr in ("eps", "variance_epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, (float, int)) and not isinstance(value, bool):
            return float(value)
    return None


def _candidate(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and weight.dtype in _CHECK_TOLERANCE
        and _eps(module) is not None
    )


def _same_function(module: nn.Module, fused: FusedRMSNorm) -> Optional[str]:
    """``None`` when ``fused`` computes what ``module`` does on a random input, else why not."""
    weight = fused.weight
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, weight.shape[0], generator=generator) * 3).to(weight.dtype)
    with torch.no_grad():
        try:
            expected = module(x)
        except Exception as exc:  # a norm with another calling convention
            return f"{type(exc).__name__}: {exc}"
        got = fused(x)
    if expected.shape != got.shape or expected.dtype != got.dtype:
        return f"gives {tuple(expected.shape)} {expected.dtype}, the kernel {tuple(got.shape)} {got.dtype}"
    atol, rtol = _CHECK_TOLERANCE[weight.dtype]
    diff = (expected.float() - got.float()).abs()
    if not bool((diff <= atol + rtol * expected.float().abs()).all()):
        return f"differs from the kernel by up to {diff.max().item():.3g}"
    return None


def swap_rms_norms(model: nn.Module, leave: "frozenset[int] | set[int]" = frozenset()) -> tuple[int, list[str]]:
    """Replace qualifying RMSNorm modules in place, but those whose id is in ``leave``;
    returns (how many, why others were kept). Loads the kernel library (``LlmcoreError`` with
    the fix when it is not built)."""
    from llmcore_kernels import ops  # noqa: F401  registers llmcore::rms_norm

    swapped, kept = 0, []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if id(child) in leave or not _candidate(child):
                continue
            fused = FusedRMSNorm(child.weight, _eps(child))
            reason = _same_function(child, fused)
            if reason is None:
                setattr(parent, name, fused)
                swapped += 1
            else:
                kept.append(f"{parent_name + '.' if parent_name else ''}{name} ({type(child).__name__}: {reason})")
    return swapped, kept


def apply(module: nn.Module, context: TransformContext) -> nn.Module:
    swapped, kept = swap_rms_norms(module)
    if swapped == 0:
        detail = f" Kept: {'; '.join(kept[:3])}." if kept else ""
        raise LlmcoreError(
            f"{TRANSFORM}: the {context.family!r} model has no RMSNorm module the fused kernel can replace.{detail}",
            fix=f"drop {TRANSFORM} from --transforms; it applies to models with Llama-style RMSNorm "
            "(x * rsqrt(mean(x^2) + eps) * weight).",
        )
    return module
