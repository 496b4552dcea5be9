"""llmcore::block_scale_search, the native form of the 8da4w recipe's activation-aware scale
search (llmcore_xnnpack.qlinear.int4_blocks_activation_aware).

The authority is the search written in torch: with the native search's order of the sum
(:func:`lane_order_search`) its choices must be equal bit for bit, in every ISA view the
machine can present; against the recipe's own torch search (torch's sum order) they may differ
only where two candidates' errors tie to the last bit."""

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


@pytest.mark.parametrize("block", [8, 32, 64, 256])
@pytest.mark.parametrize("rows", [1, 3, 300])
def test_the_native_search_chooses_what_the_torch_search_in_its_order_chooses(ops, rows, block):
    w, energy = weights(rows, 5, block, seed=rows * block)
    candidates = candidates_for(w, INT4_FRACTIONS, 7.5)
    got = torch.ops.llmcore.block_scale_search(w, energy, candidates, -8, 7)
    assert torch.equal(got, lane_order_search(w, energy, candidates, -8, 7))


def test_int8_ranges_and_a_candidate_count_not_a_multiple_of_eight(ops):
    w, energy = weights(40, 1, 96, seed=7)
    candidates = candidates_for(w, torch.linspace(0.5, 1.0, 13).tolist(), 127.0)
    got = torch.ops.llmcore.block_scale_search(w, energy, candidates, -127, 127)
    assert torch.equal(got, lane_order_search(w, energy, candidates, -127, 127))


def test_equal_errors_choose_the_first_candidate(ops):
    w, energy = weights(4, 2, 32, seed=3)
    one = candidates_for(w, [1.0], 7.5)
    candidates = one.repeat(1, 1, 3)
    candidates[..., 1:] *= 2.0  # later, larger candidates...
    candidates[..., 2] = candidates[..., 0]  # ... and one equal to the first
    got = torch.ops.llmcore.block_scale_search(w, energy, candidates, -8, 7)
    assert torch.equal(got, lane_order_search(w, energy, candidates, -8, 7))


@pytest.mark.parametrize("view", ["avxvnni", "avx2", "sse4"])
def test_the_native_search_in_every_isa_view(kernel_library, passes_in_isa_view, view):
    passes_in_isa_view(view, __file__, "chooses_what_the_torch_search or int8_ranges or equal_errors")


def test_the_recipe_search_differs_from_torchs_only_where_errors_tie(ops):
    """int4_blocks_activation_aware with the native search against the same recipe with its
    torch search (torch's sum order): the same integers and scales but in blocks whose two
    best candidates score equal errors but for the last bits."""
    from llmcore_xnnpack import qlinear

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 1024, generator=g) * 0.02
    weight[:, 5] *= 20
    energy = torch.rand(1024, generator=g) ** 4 * 10
    assert qlinear.native_block_search() is not None
    native = qlinear.int4_blocks_activation_aware(weight, 32, energy)
    saved = list(qlinear._NATIVE_SEARCH)
    qlinear._NATIVE_SEARCH[:] = [None]
    try:
        reference = qlinear.int4_blocks_activation_aware(weight, 32, energy)
    finally:
        qlinear._NATIVE_SEARCH[:] = saved
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
        ((torch.zeros(2, 3, 12), torch.ones(3, 12), torch.ones(2, 3, 4)), "a block a multiple of 8"),
        ((torch.zeros(2, 3, 8), torch.ones(3, 16), torch.ones(2, 3, 4)), "energy must be"),
        ((torch.zeros(2, 3, 8), torch.ones(3, 8), torch.ones(2, 4, 4)), "candidates must be"),
        ((torch.zeros(2, 3, 8, dtype=torch.float64), torch.ones(3, 8), torch.ones(2, 3, 4)), "float32"),
    ],
)
def test_bad_arguments_are_refused_by_name(ops, args, message):
    with pytest.raises(RuntimeError, match=f"llmcore::block_scale_search: .*{message}"):
        torch.ops.llmcore.block_scale_search(*args, -8, 7)
