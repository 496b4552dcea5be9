"""llmcore::block_round_least_error, the native form of the 8da4w recipe's activation-aware
int4 rounding (llmcore_xnnpack.qlinear.int4_blocks_activation_aware).

The authority is the search written in torch: with the native search's order of the sum
(:func:`lane_order_search`) its choices must be equal bit for bit, and its integers those of
torch's rounding with them, in every ISA view the machine can present; against the recipe's
own torch search (torch's sum order) they may differ only where two candidates' errors tie to
the last bit."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def ops(kernel_library):
    from llmcore_kernels import ops

    return ops


def lane_sum(t: torch.Tensor) -> torch.Tensor:
    """``t.sum(-1)`` in the native search's order: eight lanes, the chunks of eight added into
    them in turn, then lanes 0-3 + 4-7, 0-1 + 2-3, 0 + 1."""
    chunks = t.unflatten(-1, (-1, 8))
    lanes = chunks[..., 0, :].clone()
    for k in range(1, chunks.shape[-2]):
        lanes += chunks[..., k, :]
    half = lanes[..., :4] + lanes[..., 4:]
    quarter = half[..., :2] + half[..., 2:]
    return quarter[..., 0] + quarter[..., 1]


def lane_order_search(w, energy, candidates, qmin, qmax):
    """The recipe's torch search (qlinear._least_output_error), summed by lane_sum."""
    from llmcore_xnnpack import qlinear

    return qlinear._least_output_error(w, energy, candidates.unbind(-1), qmin, qmax, total=lane_sum)


def weights(rows: int, groups: int, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks as the recipe sees them, and the awkward ones: an outlier column, an all-zero
    block, weights already on an int4 grid (ties between candidates), zero energies."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, groups, block, generator=g) * 0.02
    w[:, :, 3] *= 30
    w[0, 0] = 0.0
    if rows > 1:
        w[1, 0] = torch.randint(-8, 8, (block,), generator=g).float() * 0.01
    energy = torch.rand(groups, block, generator=g) ** 4 * 10
    energy[0, : block // 2] = 0.0
    return w, energy


def candidates_for(w: torch.Tensor, fractions, levels: float) -> torch.Tensor:
    amax = w.abs().amax(-1).clamp(min=1e-12)
    return torch.stack([(amax * (f / levels)).to(torch.bfloat16).float() for f in fractions], -1)


INT4_FRACTIONS = torch.linspace(0.7, 1.2, 26).tolist()


def native_rounding(w, energy, fractions, levels, qmin, qmax):
    """The operator on blocks ``w [rows, groups, block]``: (q, scales, error sums)."""
    multipliers = torch.tensor([f / levels for f in fractions], dtype=torch.float32)
    rows, groups, block = w.shape
    q, scales, sums = torch.ops.llmcore.block_round_least_error(w.reshape(rows, -1), energy, multipliers, block,
                                                                qmin, qmax)
    return q.reshape(w.shape), scales, sums


def check_against_torch(w, energy, fractions, levels, qmin, qmax):
    """The operator's scales are lane_order_search's choice among the recipe's candidates,
    its integers torch's rounding with them, its error sums torch's to float32 rounding."""
    q, scales, sums = native_rounding(w, energy, fractions, levels, qmin, qmax)
    want = lane_order_search(w, energy, candidates_for(w, fractions, levels), qmin, qmax)
    assert torch.equal(scales, want)
    rounded = torch.round(w * want.reciprocal().unsqueeze(-1)).clamp(qmin, qmax)
    assert q.dtype == torch.int8 and torch.equal(q, rounded.to(torch.int8))
    diff = float((rounded * want.unsqueeze(-1) - w).double().square().sum())
    norm = float(w.double().square().sum())
    assert float(sums[0]) == pytest.approx(diff, rel=1e-5, abs=1e-30) and float(sums[1]) == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("block", [8, 32, 64, 256])
@pytest.mark.parametrize("rows", [1, 3, 300])
def test_the_native_search_chooses_what_the_torch_search_in_its_order_chooses(ops, rows, block):
    w, energy = weights(rows, 5, block, seed=rows * block)
    check_against_torch(w, energy, INT4_FRACTIONS, 7.5, -8, 7)


def test_int8_ranges_and_a_candidate_count_not_a_multiple_of_eight(ops):
    w, energy = weights(40, 1, 96, seed=7)
    check_against_torch(w, energy, torch.linspace(0.5, 1.0, 13).tolist(), 127.0, -127, 127)


def test_equal_errors_choose_the_first_candidate(ops):
    """Candidates 1x, 2x and again 1x min/max's scale: the first wins its ties with the third."""
    w, energy = weights(4, 2, 32, seed=3)
    check_against_torch(w, energy, [1.0, 2.0, 1.0], 7.5, -8, 7)


@pytest.mark.parametrize("view", ["avxvnni", "avx2", "sse4"])
def test_the_native_search_in_every_isa_view(kernel_library, passes_in_isa_view, view):
    passes_in_isa_view(view, __file__, "chooses_what_the_torch_search or int8_ranges or equal_errors")


def test_the_recipe_search_differs_from_torchs_only_where_errors_tie(ops):
    """int4_blocks_activation_aware with the native operator against the same recipe in torch
    (torch's sum order): the same integers and scales but in blocks whose two best candidates
    score equal errors but for the last bits; the same weight error to float32 rounding."""
    from llmcore_xnnpack import qlinear

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 1024, generator=g) * 0.02
    weight[:, 5] *= 20
    energy = torch.rand(1024, generator=g) ** 4 * 10
    assert qlinear.native_op("block_round_least_error") is not None
    native_error, torch_error = qlinear.ErrorSum(), qlinear.ErrorSum()
    native = qlinear.int4_blocks_activation_aware(weight, 32, energy, native_error)
    saved = dict(qlinear._NATIVE_OPS)
    qlinear._NATIVE_OPS["block_round_least_error"] = None
    try:
        reference = qlinear.int4_blocks_activation_aware(weight, 32, energy, torch_error)
    finally:
        qlinear._NATIVE_OPS.clear()
        qlinear._NATIVE_OPS.update(saved)
    assert native_error.relative == pytest.approx(torch_error.relative, rel=1e-4)
    differ = (native[1] != reference[1]).nonzero().tolist()
    assert len(differ) <= 2, differ
    blocks = weight.reshape(512, 32, 32)
    weights_ = qlinear._energy_weights(energy).reshape(32, 32)
    for row, group in differ:
        errors = []
        for d in (native[1][row, group], reference[1][row, group]):
            q = torch.round(blocks[row, group] / d).clamp(-8, 7)
            errors.append(float((weights_[group] * (blocks[row, group] - d * q) ** 2).sum()))
        assert errors[0] == pytest.approx(errors[1], rel=1e-5)
    same_scales = native[1] == reference[1]
    assert torch.equal(native[0].reshape(512, 32, 32)[same_scales], reference[0].reshape(512, 32, 32)[same_scales])


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.zeros(2, 36), torch.ones(3, 12), torch.ones(4), 12), "the block must be a multiple of 8"),
        ((torch.zeros(2, 24), torch.ones(3, 16), torch.ones(4), 8), "energy must be"),
        ((torch.zeros(2, 20), torch.ones(3, 8), torch.ones(4), 8), "in a multiple of 8"),
        ((torch.zeros(2, 24, dtype=torch.float64), torch.ones(3, 8), torch.ones(4), 8), "float32"),
        ((torch.zeros(2, 24), torch.ones(3, 8), torch.ones(2, 2), 8), "multipliers must be 1-D"),
    ],
)
def test_bad_arguments_are_refused_by_name(ops, args, message):
    with pytest.raises(RuntimeError, match=f"llmcore::block_round_least_error: .*{message}"):
        torch.ops.llmcore.block_round_least_error(*args, -8, 7)
