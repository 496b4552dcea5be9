"""qlinear's int4 / int8 linears: what they compute eagerly, and that XNNPACK runs them whole.

Authorities: for ``weight_values()``, the formula ``scales * q + offsets`` per block written
out here; for the eager forward, ``x @ weight_values().T`` with the bound that int8 per-token
activations allow (each activation moves by at most half its step ``(max - min) / 255``); for
the program, the eager module itself, run by the ExecuTorch runtime after lowering with
:class:`SharedTablePartitioner` (observed max |diff| 2e-6 for int4, 6e-6 for int8, outputs
of magnitude 14 and 38: about 1e-7 relative; bound 1e-3 relative). All test scales are
positive: XNNPACK refuses zero or negative blockwise scales (see test_gguf_recipe's Q4_0 test).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmcore_xnnpack import qlinear
from llmcore_xnnpack.qlinear import BlockInt4Linear, ChannelInt8Linear, float16_offsets

OUT, IN, BLOCK = 48, 256, 32


def bf16_values(shape, gen, scale=0.02) -> torch.Tensor:
    """Positive scales that bf16 represents exactly."""
    return (torch.rand(shape, generator=gen) * scale + scale / 4).to(torch.bfloat16).float()


def layer(kind: str, seed: int = 0) -> nn.Module:
    if kind.endswith("-split"):
        lin = layer(kind[: -len("-split")], seed)
        lin.outlier_split = True
        return lin
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (OUT, IN), generator=gen, dtype=torch.int8)
    scales = bf16_values((OUT, IN // BLOCK), gen)
    if kind == "int4":
        return BlockInt4Linear(q, scales)
    if kind == "int4-offsets":
        return BlockInt4Linear(q, scales, torch.randn(OUT, IN // BLOCK, generator=gen) * 0.05)
    if kind == "int4-bias":
        return BlockInt4Linear(q, scales, torch.randn(OUT, IN // BLOCK, generator=gen) * 0.05,
                               bias=torch.randn(OUT, generator=gen))
    q8 = torch.randint(-127, 128, (OUT, IN), generator=gen, dtype=torch.int8)
    return ChannelInt8Linear(q8, torch.rand(OUT, generator=gen) * 0.01 + 1e-3)


def inputs(seed: int = 1, rows: int = 7) -> torch.Tensor:
    return torch.randn(rows, IN, generator=torch.Generator().manual_seed(seed)) * 2.0


KINDS = ["int4", "int4-offsets", "int4-bias", "int8"]
SPLIT_KINDS = ["int4-bias-split", "int8-split"]


def with_outliers(x: torch.Tensor) -> torch.Tensor:
    """Activations as a transformer's look: a few channels far larger than the rest."""
    x = x.clone()
    x[:, [3, 77, 200]] *= 40.0
    return x


def test_weight_values_are_scales_times_q_plus_offsets():
    """bf16-representable scales and float16 offsets are kept exactly, so the weight is the
    formula, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-8, 8, (OUT, IN), generator=gen, dtype=torch.int8)
    scales = bf16_values((OUT, IN // BLOCK), gen)
    offsets = torch.randn(OUT, IN // BLOCK, generator=gen).half().float()
    expected = torch.empty(OUT, IN)
    for b in range(IN // BLOCK):
        cols = slice(b * BLOCK, (b + 1) * BLOCK)
        expected[:, cols] = scales[:, b : b + 1] * q[:, cols].float() + offsets[:, b : b + 1]
    assert torch.equal(BlockInt4Linear(q, scales, offsets).weight_values(), expected)
    assert torch.equal(BlockInt4Linear(q, scales).weight_values(), (q.float().view(OUT, -1, BLOCK)
                       * scales.unsqueeze(-1)).view(OUT, IN))
    q8, s8 = torch.randint(-127, 128, (OUT, IN), generator=gen, dtype=torch.int8), torch.rand(OUT, generator=gen)
    assert torch.equal(ChannelInt8Linear(q8, s8).weight_values(), s8[:, None] * q8.float())


def test_offsets_are_rounded_to_float16_offset_weights():
    """Any offsets become the nearest whose offset weight (``offsets * block``, what
    llmcore-kernels stores in float16) is a float16: within 2^-11 of themselves, the same
    values in every backend; beyond float16's range they are refused by name."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-8, 8, (OUT, IN), generator=gen, dtype=torch.int8)
    scales, offsets = bf16_values((OUT, IN // BLOCK), gen), torch.randn(OUT, IN // BLOCK, generator=gen) * 1e-2
    layer = BlockInt4Linear(q, scales, offsets)
    weight = layer.offset_weight.detach()
    assert torch.equal(weight.half().float(), weight) and not torch.equal(weight, offsets * BLOCK)
    assert float(((weight / BLOCK - offsets).abs() / offsets.abs()).max()) <= 2**-11
    assert torch.equal(float16_offsets(offsets, BLOCK), weight / BLOCK)
    huge = offsets.clone()
    huge[1, 2] = 4000.0
    with pytest.raises(ValueError, match="int4 block offsets reach 4000: beyond what the float16 offset weight holds"):
        BlockInt4Linear(q, scales, huge)


def test_q4_1_block_as_symmetric_int4_plus_offset():
    """A Q4_1 block (u in [0, 15], w = d*u + m) as q = u - 8, offset = m + 8d: the same weight
    up to the offset's float16 rounding (2^-11 of itself) and fp32 rounding."""
    gen = torch.Generator().manual_seed(4)
    u = torch.randint(0, 16, (OUT, IN), generator=gen)
    d = bf16_values((OUT, IN // BLOCK), gen)
    m = -torch.rand(OUT, IN // BLOCK, generator=gen) * 0.1
    exact = d.repeat_interleave(BLOCK, 1) * u.float() + m.repeat_interleave(BLOCK, 1)
    got = BlockInt4Linear((u - 8).to(torch.int8), d, m + 8 * d).weight_values()
    allowed = 2**-11 * (m + 8 * d).abs().repeat_interleave(BLOCK, 1)
    allowed += 4 * torch.finfo(torch.float32).eps * float(exact.abs().max())
    assert bool(((got - exact).abs() <= allowed).all())


def test_the_bf16_scale_error_is_the_largest_change_of_a_nonzero_scale():
    """Zero scales (a block of zeros) change nothing and divide nothing; fp16's subnormal
    scales count as any other; a weight of zero scales has no error."""
    gen = torch.Generator().manual_seed(3)
    scales = (torch.randn(64, 8, generator=gen) * 0.05).to(torch.float16)
    scales[0, :4] = 0
    scales[1, 0] = torch.finfo(torch.float16).smallest_normal / 8  # subnormal in fp16
    exact = [abs(float(torch.tensor(v).to(torch.bfloat16)) - v) / abs(v) for v in scales.float().flatten().tolist() if v]
    assert qlinear.bf16_scale_error(scales) == pytest.approx(max(exact), rel=1e-6)
    rounded = scales.float().to(torch.bfloat16).float()  # the caller's own rounding, given
    assert qlinear.bf16_scale_error(scales, rounded) == qlinear.bf16_scale_error(scales)
    assert qlinear.bf16_scale_error(torch.zeros(4, 2, dtype=torch.float16)) == 0.0
    assert qlinear.bf16_scale_error(torch.zeros(0, 2)) == 0.0


def test_rounds_scales_to_bf16_and_refuses_out_of_range_integers():
    scales = torch.full((OUT, IN // BLOCK), 0.0123456)
    lin = BlockInt4Linear(torch.zeros(OUT, IN, dtype=torch.int8), scales)
    assert torch.equal(lin.scales, scales.to(torch.bfloat16).float())
    rel = abs(float(lin.scales[0, 0]) - float(scales[0, 0])) / float(scales[0, 0])
    assert qlinear.bf16_scale_error(scales) == pytest.approx(rel, rel=1e-6) and 0 < rel < 2**-8
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        BlockInt4Linear(torch.full((OUT, IN), 8, dtype=torch.int8), scales)


@pytest.mark.parametrize("kind", KINDS)
def test_eager_is_x_times_weight_within_activation_rounding(kind):
    lin = layer(kind)
    x = inputs()
    with torch.no_grad():
        y = lin(x)
        exact = x @ lin.weight_values().T + (lin.bias if lin.bias is not None else 0)
    step = (x.amax(1).clamp(min=0) - x.amin(1).clamp(max=0)) / 255  # per token
    bound = step[:, None] / 2 * lin.weight_values().abs().sum(1)[None, :]  # |dx| <= step/2
    assert bool(((y - exact).abs() <= bound + 1e-4).all())
    assert float((y - exact).abs().max()) > 0  # the activations are quantized, not fp32


@pytest.mark.parametrize("kind", KINDS)
def test_program_matches_eager_and_is_all_delegated(kind):
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from llmcore_xnnpack.partition import SharedTablePartitioner

    model = nn.Sequential(nn.ReLU(), layer(kind)).eval()
    x = inputs(seed=2)
    with torch.no_grad():
        expected = model(x)
        exported = torch.export.export(model, (x,))
    edge = to_edge_transform_and_lower(
        exported, partitioner=[SharedTablePartitioner()],
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
    )
    calls = [n.target for n in edge.exported_program().graph_module.graph.nodes if n.op == "call_function"]
    assert calls and all(t is operator.getitem or "executorch_call_delegate" in str(t) for t in calls), calls
    buffer = edge.to_executorch().buffer
    program = Runtime.get().load_program(buffer)  # kept alive while the method runs
    method = program.load_method("forward")
    got = method.execute([x])[0]
    worst = float((got - expected).abs().max())
    assert worst < 1e-3 * float(expected.abs().max()), f"{kind}: max |diff| {worst:.3g}"


def test_negative_and_zero_scales_become_positive_exactly():
    """XNNPACK takes only positive normal scales; a Q4_0 block may have d < 0, an all-equal
    block d == 0. The layer rewrites both without changing a weight."""
    from llmcore_xnnpack.qlinear import BlockInt4Linear

    torch.manual_seed(0)
    q = torch.randint(-8, 8, (4, 64), dtype=torch.int8)
    scales = torch.tensor([[0.5, -0.25], [-1.0, 0.0], [0.125, 0.5], [-0.5, -2.0]])
    exact = (q.float().view(4, 2, 32) * scales.unsqueeze(-1)).reshape(4, 64)
    layer = BlockInt4Linear(q, scales)
    assert bool((layer.scales > 0).all())
    assert int(layer.q.min()) >= -8 and int(layer.q.max()) <= 7
    assert torch.equal(layer.weight_values(), exact)


@pytest.mark.parametrize("kind", KINDS)
def test_eager_forward_is_the_exported_forward_bit_for_bit(kind, monkeypatch):
    """Eagerly (the parity reference) the layers build their weight without the decomposed
    dequantize op's integer temporaries; the values must be the op's exactly, so the
    reference is what the graph XNNPACK lowers computes."""
    lin, x = layer(kind), inputs()
    eager = lin(x)
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)  # the graph's path, run eagerly
    assert torch.equal(lin(x), eager)


def test_weight_values_by_rows_are_the_whole_weights_rows():
    for kind in KINDS:
        lin = layer(kind)
        assert torch.equal(lin.weight_values(slice(5, 20)), lin.weight_values()[5:20])
    exact = torch.randn(OUT, IN)
    assert abs(qlinear.relative_error(layer("int8"), exact)
               - float((layer("int8").weight_values() - exact).norm() / exact.norm())) < 1e-6



@pytest.mark.parametrize("with_offsets", [False, True])
def test_the_error_of_rescaled_blocks_from_their_integers_is_the_decoded_weights(with_offsets):
    """The gguf recipe measures a kept layer's error (its scales rounded to bf16, its offsets
    to float16) from the integers alone: the same figure as decoding both weights, negative
    scales included."""
    torch.manual_seed(3)
    q = torch.randint(-8, 8, (OUT, IN), dtype=torch.int8)
    scales = (torch.randn(OUT, IN // 32) * 0.02).half().float()  # about half negative, as Q4_0 writes
    offsets = torch.randn(OUT, IN // 32) * 0.01 if with_offsets else None
    exact = (q.float().view(OUT, -1, 32) * scales.unsqueeze(-1)
             + (0 if offsets is None else offsets.unsqueeze(-1))).view(OUT, IN)
    decoded = qlinear.relative_error(BlockInt4Linear(q, scales, offsets), exact)
    assert decoded > 1e-4  # bf16 scales do change the weights
    kept = None if offsets is None else qlinear.float16_offsets(offsets, 32)
    from_integers = qlinear.rescaled_error(q, scales, scales.to(torch.bfloat16).float(), offsets, kept)
    assert from_integers == pytest.approx(decoded, rel=1e-5)
    if offsets is not None:  # the offsets' rounding counted: dropping it gives another figure
        without = qlinear.rescaled_error(q, scales, scales.to(torch.bfloat16).float(), offsets)
        assert without != pytest.approx(decoded, rel=1e-5)


def test_int8_channels_sums_its_own_rounding_error_as_relative_error_measures_it():
    w = torch.randn(OUT, IN)
    error = qlinear.ErrorSum()
    q, scales = qlinear.int8_channels(w, error)
    assert error.relative == pytest.approx(qlinear.relative_error(ChannelInt8Linear(q, scales), w), rel=1e-5)
    assert error.relative > 1e-4

def test_outlier_split_rows_add_up_to_the_token():
    x = with_outliers(inputs(rows=5))
    rows = qlinear.split_outliers(x)
    assert rows.shape == (5, 2, 1, IN)
    clamped, rest = rows[:, 0, 0], rows[:, 1, 0]
    bound = x.abs().amax(1, keepdim=True) * qlinear.OUTLIER_FRACTION
    assert torch.allclose(clamped + rest, x, rtol=1e-7, atol=0)
    assert bool((clamped.abs() <= bound).all())
    assert torch.equal(rest[x.abs() <= bound], torch.zeros(int((x.abs() <= bound).sum())))
    assert qlinear.split_outliers(x) is rows  # q, k, v share their input's split


@pytest.mark.parametrize("kind", SPLIT_KINDS)
def test_outlier_split_is_within_the_two_rows_rounding_and_beats_one_row(kind):
    lin = layer(kind)
    x = with_outliers(inputs())
    with torch.no_grad():
        y = lin(x)
        exact = x @ lin.weight_values().T + (lin.bias if lin.bias is not None else 0)
        lin.outlier_split = False
        one_row = lin(x)
    rows = qlinear.split_outliers(x)[:, :, 0]  # [tokens, 2, K]
    steps = (rows.amax(2).clamp(min=0) - rows.amin(2).clamp(max=0)) / 255  # per token and row
    bound = steps.sum(1)[:, None] / 2 * lin.weight_values().abs().sum(1)[None, :]
    assert bool(((y - exact).abs() <= bound + 1e-4).all())
    err, err_one_row = float((y - exact).abs().max()), float((one_row - exact).abs().max())
    assert err < err_one_row / 3, (err, err_one_row)


@pytest.mark.parametrize("kind", SPLIT_KINDS)
def test_outlier_split_program_matches_eager_at_any_token_count(kind):
    """Exported with a dynamic token count, as the LLM programs are: XNNPACK takes the split
    whole (it refuses slices and unsqueezes of dynamic tensors, and symbolic views)."""
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from llmcore_xnnpack.partition import SharedTablePartitioner

    model = nn.Sequential(nn.ReLU(), layer(kind)).eval()
    tokens = torch.export.Dim("tokens", min=1, max=64)
    exported = torch.export.export(model, (inputs(seed=2),), dynamic_shapes=({0: tokens},))
    edge = to_edge_transform_and_lower(
        exported, partitioner=[SharedTablePartitioner()],
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
    )
    calls = [n.target for n in edge.exported_program().graph_module.graph.nodes if n.op == "call_function"]
    assert calls and all(t is operator.getitem or "executorch_call_delegate" in str(t) for t in calls), calls
    program = Runtime.get().load_program(edge.to_executorch().buffer)
    method = program.load_method("forward")
    for rows in (1, 9):
        x = with_outliers(inputs(seed=rows, rows=rows))
        with torch.no_grad():
            expected = model(x)
        got = method.execute([x])[0]
        worst = float((got - expected).abs().max())
        assert worst < 1e-3 * float(expected.abs().max()), f"{kind}, {rows} rows: max |diff| {worst:.3g}"


def test_layers_reading_one_input_share_its_block_means():
    """q, k and v (gate and up) read the same tensor: one mean per block for all of them, in
    the traced graph as in eager runs."""

    class Three(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = layer("int4-offsets", 0), layer("int4-offsets", 1), layer("int4-offsets", 2)

        def forward(self, x):
            return self.a(x) + self.b(x) + self.c(x.relu())  # c reads another tensor

    x = inputs()
    graph = torch.export.export(Three().eval(), (x,)).graph
    means = [n for n in graph.nodes if n.op == "call_function" and "mean" in str(n.target)]
    assert len(means) == 2


def q4_1_grid(gen, rows=OUT, cols=IN, block=BLOCK):
    """Weights a Q4_1 quantizer wrote: per block ``d*u + m``, u spanning [0, 15], d in bf16,
    m in float16 (Q4_1's type); and their ``u``."""
    u = torch.randint(0, 16, (rows, cols), generator=gen)
    u[:, ::block], u[:, 1::block] = 0, 15  # min/max chose the grid: both ends are used
    d = bf16_values((rows, cols // block), gen)
    m = (-torch.rand(rows, cols // block, generator=gen) * 0.1).half().float()
    return (u.view(rows, -1, block) * d.unsqueeze(-1) + m.unsqueeze(-1)).view(rows, cols), u


def test_affine_blocks_give_a_q4_1_grid_its_integers_back():
    """Its integers exactly; its weights up to the offsets' float16 rounding (2^-11 of m + 8d)."""
    exact, u = q4_1_grid(torch.Generator().manual_seed(5))
    q, scales, offsets = qlinear.int4_blocks_affine(exact, BLOCK)
    assert torch.equal(q, (u - 8).to(torch.int8))
    assert 0 < qlinear.relative_error(BlockInt4Linear(q, scales, offsets), exact) < 2e-4
    # the symmetric grid cannot hold it
    sym_q, sym_scales = qlinear.int4_blocks(exact, BLOCK, hqq=True)
    assert qlinear.relative_error(BlockInt4Linear(sym_q, sym_scales), exact) > 0.01


def test_affine_blocks_beat_their_min_max_start_and_the_symmetric_grid():
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(6)) * 0.02
    w[:, 9] *= 6  # an outlier column, as real layers have
    q, scales, offsets = qlinear.int4_blocks_affine(w, BLOCK)
    fitted = qlinear.relative_error(BlockInt4Linear(q, scales, offsets), w)
    blocks = w.view(OUT, -1, BLOCK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = ((hi - lo) / 15).to(torch.bfloat16).float()
    u = torch.round((blocks - lo.unsqueeze(-1)) / d.unsqueeze(-1)).clamp(0, 15)
    min_max = qlinear.relative_error((u * d.unsqueeze(-1) + lo.unsqueeze(-1)).view(OUT, IN), w)
    sym_q, sym_scales = qlinear.int4_blocks(w, BLOCK, hqq=True)
    symmetric = qlinear.relative_error(BlockInt4Linear(sym_q, sym_scales), w)
    assert fitted < 0.95 * min_max and fitted < 0.8 * symmetric, (fitted, min_max, symmetric)


def test_affine_constant_blocks_are_their_float16_values():
    """A constant block is all offset: exact where its value is a float16 (0.375, -1.5, 0),
    the nearest float16 otherwise (0.37)."""
    w = torch.zeros(5, 2 * BLOCK)
    w[:, :BLOCK] = 0.375
    w[1, BLOCK:] = -1.5
    q, scales, offsets = qlinear.int4_blocks_affine(w, BLOCK)
    assert torch.equal(BlockInt4Linear(q, scales, offsets).weight_values(), w)
    w[4, BLOCK:] = 0.37
    q, scales, offsets = qlinear.int4_blocks_affine(w, BLOCK)
    assert torch.equal(BlockInt4Linear(q, scales, offsets).weight_values(), w.half().float())


def _output_error(q, scales, w, x) -> float:
    """||x W_q^T - x W^T|| / ||x W^T||: what a layer's rounding costs on these inputs."""
    approx = BlockInt4Linear(q, scales).weight_values()
    return float((x @ (approx - w).T).norm() / (x @ w.T).norm())


def test_activation_aware_scales_cut_the_output_error_where_a_few_inputs_dominate():
    """Inputs whose energy sits in a few features (an LLM's outlier channels): scales chosen
    for the output error beat scales chosen for the weight error (HQQ's, min/max's) on the
    output of held-out inputs drawn the same way, at a slightly larger weight error."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(OUT, IN, generator=gen) * 0.02
    loud = torch.ones(IN)
    loud[torch.randperm(IN, generator=gen)[:6]] = 25.0

    def inputs(n: int) -> torch.Tensor:
        return torch.randn(n, IN, generator=gen) * loud

    calibration, held_out = inputs(256), inputs(256)
    q, scales = qlinear.int4_blocks_activation_aware(w, BLOCK, calibration.square().mean(0))
    aware = _output_error(q, scales, w, held_out)
    hqq = _output_error(*qlinear.int4_blocks(w, BLOCK, hqq=True), w, held_out)
    min_max = _output_error(*qlinear.int4_blocks(w, BLOCK, hqq=False), w, held_out)
    assert aware < 0.85 * hqq and aware < 0.85 * min_max, (aware, hqq, min_max)


def test_activation_aware_scales_are_the_programs_and_uniform_energy_is_a_weight_error_search():
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(OUT, IN, generator=gen) * 0.02
    w[:, 3] *= 8
    w[2, :BLOCK] = 0  # an all-zero block stays zero
    q, scales = qlinear.int4_blocks_activation_aware(w, BLOCK, torch.ones(IN))
    assert int(q.min()) >= -8 and int(q.max()) <= 7 and not q[2, :BLOCK].any()
    assert torch.equal(scales, scales.to(torch.bfloat16).float())  # what XNNPACK stores
    assert bool((scales > 0).all())
    # with every feature equally loud the objective is the weight error: no worse than min/max's
    searched = qlinear.relative_error(BlockInt4Linear(q, scales), w)
    min_max = qlinear.relative_error(BlockInt4Linear(*qlinear.int4_blocks(w, BLOCK, hqq=False)), w)
    assert searched <= min_max, (searched, min_max)


def _int8_output_error(q, scales, w, x) -> float:
    approx = ChannelInt8Linear(q, scales).weight_values()
    return float((x @ (approx - w).T).norm() / (x @ w.T).norm())


def test_activation_aware_int8_channels_cut_the_output_error_of_rows_with_outlier_weights():
    """Rows with a few large weights on inputs the text rarely excites (min/max's scale is
    set by them): per-channel int8 scales chosen for the output error beat min/max's on
    held-out inputs drawn the same way."""
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(OUT, IN, generator=gen) * 0.02
    quiet = torch.randperm(IN, generator=gen)[:4]
    w[:, quiet] *= 4.0
    loud = torch.ones(IN)
    loud[quiet] = 0.05

    def inputs(n: int) -> torch.Tensor:
        return torch.randn(n, IN, generator=gen) * loud

    calibration, held_out = inputs(256), inputs(256)
    aware = _int8_output_error(*qlinear.int8_channels_activation_aware(w, calibration.square().mean(0)), w, held_out)
    min_max = _int8_output_error(*qlinear.int8_channels(w), w, held_out)
    assert aware < 0.92 * min_max, (aware, min_max)  # observed 0.876x


def test_activation_aware_int8_channels_with_uniform_energy_are_no_worse_than_min_max():
    gen = torch.Generator().manual_seed(10)
    w = torch.randn(OUT, IN, generator=gen) * 0.02
    w[3] = 0  # an all-zero row stays zero with a positive scale
    q, scales = qlinear.int8_channels_activation_aware(w, torch.ones(IN))
    assert int(q.min()) >= -127 and int(q.max()) <= 127 and not q[3].any()
    assert bool((scales > 0).all())
    searched = qlinear.relative_error(ChannelInt8Linear(q, scales), w)
    min_max = qlinear.relative_error(ChannelInt8Linear(*qlinear.int8_channels(w)), w)
    assert searched <= min_max, (searched, min_max)


@pytest.mark.parametrize("shape", [(128, 576), (64, 1536), (32, 2, 1, 96)])
def test_rounded_per_token_is_the_decomposed_operators_rounding(shape):
    """The channel-scale search's fast rounding gives the graph's int8-per-token values (rows
    with outlier features, all-positive rows, all-zero rows), but for rounding ties: at
    most one value in 10^5, by one step."""
    torch.manual_seed(sum(shape))
    x = torch.randn(20, *shape) * torch.rand(shape[-1]) * 3
    x[:, 0] = x[:, 0].abs()  # no negative values: the zero point sits at the bottom
    x[:, 1] = 0.0
    x[:, 2, ..., 5] = 80.0  # an outlier feature
    fast, graph = qlinear.rounded_per_token(x), qlinear.quantize_activations(x)
    differ = fast != graph
    assert int(differ.sum()) <= x.numel() // 100_000
    step = (x.amax(-1, keepdim=True).clamp(min=0) - x.amin(-1, keepdim=True).clamp(max=0)) / 255
    assert torch.all((fast - graph).abs() <= step * 1.001)
    assert torch.equal(fast[:, 1], graph[:, 1]) and float(fast[:, 1].abs().max()) == 0.0


def test_rounded_per_block_is_each_blocks_own_symmetric_int8():
    """llmcore-kernels' rounding of an int4 layer's activations: each block of 32 on its own
    scale max |x| / 127, each value its nearest level, an all-zero block zero; a token's
    outlier coarsens its own block only, so on a token with one the values land nearer x
    than one scale a token puts them. Inside kernels_rounding an int4 layer rounds so, and
    per token outside it (XNNPACK's)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 96, generator=g)
    x[0, 0, 3] = 80.0  # an outlier feature
    x[1, 2, 32:64] = 0.0  # an all-zero block
    rounded = qlinear.rounded_per_block(x)
    blocks, got = x.view(3, 5, 3, 32), rounded.view(3, 5, 3, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    assert torch.all((got - blocks).abs() <= step * 0.5 * 1.001)
    levels = got / torch.where(step == 0, 1.0, step)
    assert torch.all((levels - levels.round()).abs() < 1e-3) and float(levels.abs().max()) <= 127.001
    assert float(rounded[1, 2, 32:64].abs().max()) == 0.0
    # the outlier's token: its other blocks as fine as any other token's (a tenth of the error
    # of the token's one scale there; measured 0.074)
    per_token = qlinear.rounded_per_token(x)
    assert float((rounded[0, 0, 32:] - x[0, 0, 32:]).norm()) < 0.1 * float((per_token[0, 0, 32:] - x[0, 0, 32:]).norm())
    linear = BlockInt4Linear(torch.randint(-8, 8, (16, 96), generator=g, dtype=torch.int8), torch.rand(16, 3) / 8)
    with torch.no_grad():
        outside = linear(x)
        with qlinear.kernels_rounding():
            inside = linear(x)
    assert torch.allclose(outside, F.linear(per_token, linear.weight_values()), atol=1e-5)
    assert torch.allclose(inside, F.linear(rounded, linear.weight_values()), atol=1e-5)


@pytest.mark.parametrize("kind", ["int4", "int4-offsets", "int4-bias"])
def test_int4_held_as_nibbles_computes_the_same_and_unpacks_to_the_same_integers(kind, monkeypatch):
    """``nibbles=True`` (what llmcore-kernels asks of the gguf recipe): half the bytes, the
    same integers by rows and whole, the same eager output; export refuses it until
    ``unpack_()``, after which it is the plain layer, bit for bit."""
    plain = layer(kind)
    packed = BlockInt4Linear(plain.q, plain.scales, None if plain.offset_weight is None else
                             plain.offset_weight / plain.block, plain.bias, nibbles=True)
    assert packed.q is None and packed.q_nibbles.dtype == torch.uint8
    assert packed.q_nibbles.numel() * 2 == plain.q.numel()
    assert torch.equal(packed.integers(), plain.q) and torch.equal(packed.integers(slice(5, 9)), plain.q[5:9])
    x = inputs()
    assert torch.equal(packed(x), plain(x))
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    with pytest.raises(ValueError, match="nibbles"):
        packed(x)
    packed.unpack_()
    assert packed.q_nibbles is None and torch.equal(packed.q, plain.q)
    assert torch.equal(packed(x), plain(x))


def test_nibbles_round_trip_every_int4_value():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 4)  # [3, 64]: each value at even and odd columns
    assert torch.equal(qlinear.unpack_nibbles(qlinear.pack_nibbles(q)), q)


def test_the_int4_searchs_candidates_are_amax_times_each_fraction_bit_for_bit():
    """The activation-aware int4 search makes its 26 candidate scales in one product with
    float32 multipliers; they must be the scales ``amax * (fraction / 7.5)`` gave, rounded to
    bf16, or the recipe's integers would change with the way they are computed."""
    g = torch.Generator().manual_seed(0)
    amax = (torch.randn(300, 64, generator=g).abs() * 0.05).clamp(min=1e-12)
    amax[0, :6] = torch.tensor([1e-12, 3e-7, 1.0, 7.5, 123.456, 6.1e4])
    one_by_one = torch.stack([(amax * (f / 7.5)).to(torch.bfloat16).float() for f in qlinear._SCALE_FRACTIONS], -1)
    at_once = (amax.unsqueeze(-1) * qlinear._SCALE_MULTIPLIERS).to(torch.bfloat16).float()
    assert torch.equal(at_once, one_by_one)
