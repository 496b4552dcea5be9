"""Per-input-channel scales chosen for quantization and folded where they cost nothing (AWQ's idea).

A linear layer's error after its weights are rounded is ``x . (w - w_rounded)``. In an LLM a
few input channels carry most of the activation magnitude, and a rounding grid fitted to the
weights alone spends its levels evenly. Multiplying input column ``j`` of the weights by
``s_j`` and dividing the activations by ``s_j`` leaves the float product as it was, but
gives the columns that meet large activations more of the grid; it also shrinks the
activation outliers that per-token int8 activations round poorly.

The division is free where the activations come out of a per-channel multiply: a norm's
weight, or the rows of a linear whose output reaches the consumer through operations that
are linear per channel (attention's values reach the output projection that way, and in a
gated MLP the up projection's output multiplies the gate). A model says where: its
``scalable_channels()`` method returns :class:`~llmcore.records.ScalableChannels` records.
Families that do not list any get no scaling.

Per group of linears sharing an input, the scales are ``s = m ** alpha`` (``m``: each
channel's mean magnitude on calibration text), ``alpha`` searched on a grid for the least
output error of the backend's own rounding of weights and activations (which the caller
passes in; ``alpha = 0`` is "no scaling", so the search never picks worse than that on the
calibration text). After folding, the float model must give the logits it gave before on a
few calibration tokens: a model that lists a fold its arithmetic does not allow fails the
export here instead of producing a program with wrong logits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from llmcore import stored
from llmcore.errors import LlmcoreError
from llmcore.records import Calibration, ScalableChannels

log = logging.getLogger(__name__)

ALPHAS = tuple(i / 10 for i in range(11))
"""Exponents tried per group, from no scaling to the channels' whole mean magnitude
(docs/quantization.md, "Channel scales", has the ones SmolLM2 chose)."""

KEPT_ROWS = 128
"""Calibration rows (tokens) of each group's input the search scores: on SmolLM2 these gave
the same mean KL from fp32 as the whole built-in text (docs/quantization.md, "Channel
scales")."""

ROW_STRIDE = 4
"""The search scores every 4th output row of each consumer (the error is a sum over rows)."""

CHECK_TOKENS = 32
"""Calibration tokens run through the model before and after folding to check the fold."""


@dataclass(frozen=True)
class FoldedScales:
    """What :meth:`ScaleSearch.fold` did: per consumer linear the scales its input columns
    were multiplied by (the caller divides its input statistics of those layers by their
    squares), and per group the alpha chosen and the calibration output error relative to
    no scaling."""

    columns: dict[str, torch.Tensor]
    alphas: list[float]
    error_ratios: list[float]

    def summary(self) -> str:
        if not self.alphas:
            return "no channel scales (no calibration rows)"
        middle = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
        return (f"channel scales on {len(self.alphas)} groups (alpha median {middle(self.alphas):g}, "
                f"calibration output error {100 * (middle(self.error_ratios) - 1):+.0f}% median)")


def scalable_channels(module: Any) -> list[ScalableChannels]:
    """The groups ``module`` lists (its ``scalable_channels()``), or none."""
    listed = getattr(module, "scalable_channels", None)
    return list(listed()) if callable(listed) else []


def source_statistic(group: ScalableChannels, x: torch.Tensor) -> torch.Tensor:
    """Each source channel's mean magnitude over the consumer input rows ``x`` (the mean over
    the columns it feeds, when it feeds several)."""
    m = x.abs().mean(0)
    if group.repeats > 1:
        m = m.view(-1, group.repeats, group.head_dim).mean(1).reshape(-1)
    return m


def consumer_columns(group: ScalableChannels, s: torch.Tensor) -> torch.Tensor:
    """Source channel scales as the consumers' input-column scales."""
    if group.repeats == 1:
        return s
    return s.view(-1, 1, group.head_dim).expand(-1, group.repeats, group.head_dim).reshape(-1)


def _scales(m: torch.Tensor, alpha: float) -> torch.Tensor:
    """``m ** alpha``, normalised so the largest and smallest scale are reciprocal (AWQ's
    choice: the weights' overall magnitude stays where it was)."""
    s = m.clamp(min=1e-4 * float(m.mean()) + 1e-12).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def choose_scales(
    group: ScalableChannels,
    x: torch.Tensor,
    weights: list[torch.Tensor],
    round_weight: Callable[[int, torch.Tensor], torch.Tensor],
    round_input: Callable[[torch.Tensor], torch.Tensor],
    alphas=ALPHAS,
) -> tuple[float, torch.Tensor, float, float]:
    """``(alpha, source scales, error, error at alpha 0)`` for one group: the alpha whose scales
    give the least ``sum ||x W^T - round_input(x/s) round_weight(W s)^T||^2`` over the
    consumers' float weights ``weights`` (``round_weight(i, w)``: consumer ``i``'s weight as
    the program would hold it).

    The error is summed over every :data:`ROW_STRIDE`-th output row only, and ``alphas`` are
    tried in order until the error grows: it falls and then rises with alpha (too little
    scaling leaves the large channels coarse, too much starves the rest), so the walk stops
    one step past the least (docs/quantization.md, "Channel scales", says where it stopped
    on SmolLM2).
    ``alphas`` start at 0, no scaling, so the choice is never worse than none on ``x``."""
    x = x.float()
    m = source_statistic(group, x)
    weights = [w[::ROW_STRIDE] for w in weights]
    exact = [x @ w.T for w in weights]
    best = None
    plain = float("nan")
    for alpha in alphas:
        s = _scales(m, alpha) if alpha else torch.ones_like(m)
        cols = consumer_columns(group, s)
        xq = round_input(x / cols)
        err = sum(float((y - xq @ round_weight(i, w * cols).T).square().sum())
                  for i, (y, w) in enumerate(zip(exact, weights)))
        if alpha == 0:
            plain = err
        if best is not None and err >= best[0]:
            break
        best = (err, alpha, s)
    err, alpha, s = best
    return alpha, s, err, plain


def fold(module: Any, group: ScalableChannels, s: torch.Tensor) -> torch.Tensor:
    """Divide ``group.source``'s output channels by ``s``, multiply the consumers' input columns
    by the matching scales; returns those column scales. New tensors, not in-place writes: a
    loader's weights may be views of a read-only file."""
    source = module.get_submodule(group.source)
    if not stored.rescale(source.weight, rows=s):  # a weight still in the file is scaled as it is read
        column = s.view(-1, *([1] * (source.weight.dim() - 1)))
        source.weight.data = source.weight.data / column.to(source.weight.dtype)
    if getattr(source, "bias", None) is not None:
        source.bias.data = source.bias.data / s.to(source.bias.dtype)
    cols = consumer_columns(group, s)
    for name in group.linears:
        linear = module.get_submodule(name)
        if not stored.rescale(linear.weight, cols=cols):
            linear.weight.data = linear.weight.data * cols.to(linear.weight.dtype)
    return cols


def _check_shapes(module: Any, group: ScalableChannels) -> None:
    source = module.get_submodule(group.source)
    channels = source.weight.shape[0]
    width = channels * group.repeats
    for name in group.linears:
        linear = module.get_submodule(name)
        if linear.weight.dim() != 2 or linear.weight.shape[1] != width:
            raise LlmcoreError(
                f"{type(module).__name__}.scalable_channels() lists {name} as reading the {channels} channels of "
                f"{group.source} (x{group.repeats}), but its weight is {tuple(linear.weight.shape)}.",
                stage="quantize",
                fix="correct the model's scalable_channels(), or export with --quantize-option awq=false.",
            )


class ScaleSearch:
    """Chooses every group's scales while the float model reads calibration text, then folds them.

    The caller hooks the first consumer of each group (:attr:`inputs`) and passes what it
    reads to :meth:`record`; as soon as a group has :data:`KEPT_ROWS` rows its scales are
    chosen and the rows dropped, so the search holds one group's rows at a time rather than
    every layer's (~50 MiB for SmolLM2). Every search sees the float model's own weights:
    nothing is folded until :meth:`fold`.

    ``round_weight(name, w)`` is the backend's rounding of consumer ``name``'s weight,
    ``round_input(x)`` its rounding of activations.
    """

    def __init__(self, module: Any, groups: list[ScalableChannels],
                 round_weight: Callable[[str, torch.Tensor], torch.Tensor],
                 round_input: Callable[[torch.Tensor], torch.Tensor], alphas=ALPHAS):
        for group in groups:
            _check_shapes(module, group)
        self.module = module
        self.by_input = {group.linears[0]: group for group in groups}
        self.round_weight, self.round_input, self.alphas = round_weight, round_input, alphas
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.chosen: dict[str, tuple[float, torch.Tensor, float, float]] = {}

    @property
    def inputs(self) -> list[str]:
        """The linears whose inputs :meth:`record` needs."""
        return list(self.by_input)

    def record(self, name: str, x: torch.Tensor) -> None:
        """Calibration rows ``x [tokens, features]`` entering linear ``name``."""
        if name in self.chosen:
            return
        rows = self.rows.setdefault(name, [])
        room = KEPT_ROWS - sum(r.shape[0] for r in rows)
        rows.append(x[:room].detach().float().clone())
        if x.shape[0] >= room:
            self._choose(name)

    def _choose(self, name: str) -> None:
        group = self.by_input[name]
        x = torch.cat(self.rows.pop(name))
        weights = [stored.floats(self.module.get_submodule(n).weight) for n in group.linears]
        self.chosen[name] = choose_scales(
            group, x, weights, lambda i, w: self.round_weight(group.linears[i], w), self.round_input, self.alphas)

    def fold(self, calibration: Calibration, text: str = "") -> FoldedScales:
        """Fold the chosen scales (choosing first for groups that saw fewer rows than
        :data:`KEPT_ROWS`) and check the float model's logits on calibration tokens."""
        for name in list(self.rows):
            self._choose(name)
        unseen = [n for n in self.by_input if n not in self.chosen]
        if unseen:  # e.g. a layer no calibration token reached: it keeps its channels
            log.warning("channel scales: the calibration text never reached %s; left unscaled", ", ".join(unseen))
        check_ids = calibration.token_ids(text)[:CHECK_TOKENS]
        before = _check_logits(self.module, calibration, check_ids)
        columns, alphas, ratios = {}, [], []
        for name, (alpha, s, err, plain) in self.chosen.items():
            group = self.by_input[name]
            cols = fold(self.module, group, s)
            for linear in group.linears:
                columns[linear] = columns[linear] * cols if linear in columns else cols
            alphas.append(alpha)
            ratios.append(err / plain if plain else 1.0)
        after = _check_logits(self.module, calibration, check_ids)
        moved = float((after - before).abs().max())
        if not moved <= 1e-3 * max(1.0, float(before.abs().max())):
            raise LlmcoreError(
                f"folding channel scales changed {type(self.module).__name__}'s float logits by up to {moved:.3g}: "
                "its scalable_channels() lists a fold its arithmetic does not allow.",
                stage="quantize",
                fix="export with --quantize-option awq=false, and report the model family.",
            )
        return FoldedScales(columns, alphas, ratios)


def _check_logits(module: Any, calibration: Calibration, ids: list[int]) -> torch.Tensor:
    """The model's outputs for calibration tokens ``ids``."""
    outputs = []
    hook = module.register_forward_hook(lambda _m, _a, out: outputs.append(out.detach().float().clone()))
    try:
        calibration.run(module, ids)
    finally:
        hook.remove()
    return torch.cat([o.reshape(-1) for o in outputs])
