"""Weights as the checkpoint stores them: integers and per-block scales, kept beside the floats.

A quantized checkpoint (a GGUF's Q4_1 linears, say) already holds integers that someone
chose with care. Loaders dequantize every tensor so that the eager model, the parity
reference and float recipes work as usual; a loader that can also say *which integers and
scales* a weight came from hands them over as :class:`IntegerWeight` records, and a
quantizer recipe that can carry them into the program (XNNPACK's ``gguf`` recipe) puts them
in unchanged instead of rounding the dequantized floats a second time.

The records travel with the weight tensors themselves (``remember`` / ``integer_form``), not
with module names: source transforms replace modules (KV-cache attention, norms) but keep the
weights, and a weight a transform rebuilt simply has no integer form any more, which a recipe
reports by name instead of silently using stale integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

_FORMS: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclass(frozen=True)
class IntegerWeight:
    """``weight[o, i] == scales[o, i // block] * q[o, i] + offsets[o, i // block]`` (fp32).

    ``q`` is int8 ``[out, in]``; ``scales`` and ``offsets`` are float32 ``[out, in // block]``,
    ``offsets`` None where the format has none (Q4_0, Q8_0). ``bits`` is how many bits the
    integers use: 4-bit formats store ``q`` in ``[-8, 7]`` (a GGUF's unsigned nibbles minus 8,
    the 8 moved into the offsets), 8-bit ones in ``[-128, 127]``.
    """

    format: str
    """The checkpoint's name for the encoding, e.g. ``Q4_1`` (GGML type names)."""
    source_name: str
    """The tensor's name in the checkpoint file, for messages."""
    bits: int
    block: int
    q: torch.Tensor
    scales: torch.Tensor
    offsets: Optional[torch.Tensor] = None

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.q.shape
        w = self.q.float().view(rows, cols // self.block, self.block) * self.scales.unsqueeze(-1)
        if self.offsets is not None:
            w = w + self.offsets.unsqueeze(-1)
        return w.reshape(rows, cols)


@dataclass(frozen=True)
class StoredFormat:
    """A weight the checkpoint stored in a form with no :class:`IntegerWeight` (F16, Q6_K, ...):
    only its name, so a recipe can say which tensors it had to round afresh."""

    format: str
    source_name: str


def remember(weight: torch.Tensor, form: "IntegerWeight | StoredFormat") -> None:
    _FORMS[weight] = form


def stored_form(weight: Any) -> "IntegerWeight | StoredFormat | None":
    """What the checkpoint stored for this weight tensor, or None (float checkpoints, or a
    weight that a transform rebuilt)."""
    return _FORMS.get(weight) if isinstance(weight, torch.Tensor) else None


def attach(module: torch.nn.Module, forms: Mapping[str, "IntegerWeight | StoredFormat"]) -> int:
    """Tie ``forms`` (keyed by parameter name) to ``module``'s parameters; returns how many.

    A parameter shared by two names (a tied embedding and output layer) gets the one form.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    done = 0
    for name, form in forms.items():
        if name in params:
            remember(params[name], form)
            done += 1
    return done
