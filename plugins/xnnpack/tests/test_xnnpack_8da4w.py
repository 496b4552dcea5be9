"""The ``8da4w`` recipe: int4-weight / int8-activation linears in XNNPACK, optional int8 /
int4 embeddings in the runtime's quantized embedding kernels.

Every program is the tiny nanoGPT (random weights, seed 0; logits span about +-1), run by
the ExecuTorch runtime as a prefill at lengths 1, 17, 64 and 128 and as 8 decode steps after
a 16-token prefill, against two eager references recomputing the whole sequence:

* the fp32 model: the quantization error. Observed max |logit diff|: 8da4w 0.075, with
  8-bit embeddings 0.073, with 4-bit embeddings 0.082, with group_size=128 0.101; bound
  0.2 for all, and the same argmax at every step;
* the same model quantized in eager PyTorch (llmcore_xnnpack.recipes, weight scales
  rounded to bf16 as XNNPACK stores them): what lowering adds, i.e. XNNPACK's own per-token activation
  quantization and accumulation order. Observed 0.0049 or less; bound 0.02.
"""

from __future__ import annotations

import pytest
import torch

from llmcore.errors import LlmcoreError
from llmcore.records import Calibration
from llmcore.runtime import Program
from llmcore_nanogpt.model import CONFIGS, GPT
from llmcore_xnnpack.recipes import quantize_8da4w
from llmcore_xnnpack.torchao_quant import linear_group

# variant -> (bound vs fp32 eager, bound vs quantized eager)
BOUNDS = {
    "8da4w": (0.2, 0.02),
    "8da4w-emb0": (0.2, 0.02),
    "8da4w-emb4": (0.2, 0.02),
    "8da4w-asymmetric": (0.2, 0.02),
}
PREFILL_LENGTHS = (1, 17, 64, 128)
N_LINEAR = 13  # 2 blocks x (q, k, v after split-qkv, attn.c_proj, c_fc, mlp.c_proj) + lm_head


def fp32_tiny() -> GPT:
    return GPT(CONFIGS["tiny"]).init_random(0).eval()


def quantized_tiny(defaults: dict, options: dict, calibration) -> GPT:
    return quantize_8da4w(fp32_tiny(), {**defaults, **options}, calibration)


def worst_diffs(program: Program, references: list) -> list[float]:
    """Max |logit diff| against each reference, over prefills and decode steps; asserts
    the argmax agrees with the first reference (the fp32 model) at every step."""
    gen = torch.Generator().manual_seed(1)
    cases = []  # (tokens fed to the program, position, the whole sequence so far)
    for length in PREFILL_LENGTHS:
        seq = torch.randint(0, 257, (1, length), generator=gen)
        cases.append((seq[0].tolist(), 0, seq))
    seq = torch.randint(0, 257, (1, 24), generator=gen)
    cases.append((seq[0, :16].tolist(), 0, seq[:, :16]))
    cases += [([int(seq[0, pos])], pos, seq[:, : pos + 1]) for pos in range(16, 24)]

    worst = [0.0] * len(references)
    for tokens, pos, whole in cases:
        got = program.logits(tokens, pos)
        with torch.no_grad():
            expected = [ref(whole)[0] for ref in references]
        for i, e in enumerate(expected):
            worst[i] = max(worst[i], (got - e).abs().max().item())
        assert int(got.argmax()) == int(expected[0].argmax()), f"argmax differs at {len(whole[0])} tokens"
    return worst


@pytest.mark.parametrize(
    "variant, options",
    [("8da4w", {}), ("8da4w-emb0", {"embedding_bits": 0}), ("8da4w-emb4", {"embedding_bits": 4}),
     ("8da4w-asymmetric", {"asymmetric": True})],
)
def test_logits_within_bounds_of_fp32_and_of_quantized_eager(
    xnnpack_exports, recipe_defaults, tiny_calibration, variant, options
):
    result = xnnpack_exports(variant)
    program = Program.load(result.pte)
    assert program.use_kv_cache
    vs_fp32, vs_quantized = worst_diffs(program, [fp32_tiny(), quantized_tiny(recipe_defaults, options, tiny_calibration)])
    bound_fp32, bound_quantized = BOUNDS[variant]
    assert vs_fp32 <= bound_fp32, f"{variant}: max |diff| vs fp32 {vs_fp32:.4f}"
    assert vs_quantized <= bound_quantized, f"{variant}: max |diff| vs quantized eager {vs_quantized:.5f}"
    assert vs_quantized < vs_fp32 / 5  # the program is much closer to its quantized twin
    assert result.report["parity"]["max_abs_diff"] <= bound_quantized


def test_every_linear_runs_in_an_xnnpack_delegate(xnnpack_exports):
    delegation = xnnpack_exports("8da4w").report["delegation"]
    xnn_ops = delegation["by_backend"]["XnnpackBackend"]["operators"]
    assert xnn_ops.get("aten_linear_default") == N_LINEAR
    # each linear: a dynamic per-token quantization of its input, its weight dequantized:
    # int4 per block for the block linears, int8 per channel for the output layer
    assert xnn_ops.get("quantized_decomposed_choose_qparams_per_token_asymmetric_default") == N_LINEAR
    assert xnn_ops.get("quantized_decomposed_dequantize_per_channel_group_default") == N_LINEAR - 1
    assert xnn_ops.get("quantized_decomposed_dequantize_per_channel_default") == 1
    rows = {r["op_type"]: r for r in delegation["operators"]}
    assert rows["aten_linear_default"]["not_delegated"] == 0
    # the int8 table's lookup runs in the portable runtime (XNNPACK has no gather); the rest is delegated
    lookup = rows.pop("quantized_decomposed_embedding_byte_dtype")
    assert (lookup["delegated"], lookup["not_delegated"]) == (0, 1)
    assert all(r["not_delegated"] == 0 for op, r in rows.items() if op.startswith("quantized_decomposed"))


def test_asymmetric_blocks_are_closer_to_fp32_and_all_delegated(xnnpack_exports, recipe_defaults, tiny_calibration):
    """``asymmetric=true``: each block's minimum runs as the offset term (a mean per block and
    a small GEMM, both in the layer's delegate); the weights are closer to the fp32 ones."""
    from llmcore_xnnpack.qlinear import BlockInt4Linear, relative_error

    def mean_error(model) -> float:
        exact = dict(fp32_tiny().named_modules())
        errors = [relative_error(m, exact[n].weight) for n, m in model.named_modules() if isinstance(m, BlockInt4Linear)]
        assert errors
        return sum(errors) / len(errors)

    symmetric = mean_error(quantized_tiny(recipe_defaults, {}, tiny_calibration))
    asymmetric = mean_error(quantized_tiny(recipe_defaults, {"asymmetric": True}, tiny_calibration))
    assert asymmetric < 0.85 * symmetric, (asymmetric, symmetric)

    delegation = xnnpack_exports("8da4w-asymmetric").report["delegation"]
    xnn_ops = delegation["by_backend"]["XnnpackBackend"]["operators"]
    # the int4 GEMMs, the output layer's int8 one and one offset GEMM per int4 layer
    assert xnn_ops.get("aten_linear_default") == 2 * N_LINEAR - 1
    # one block mean per input: (q, k, v), attention output, MLP input, MLP hidden, per block
    # (beyond the layer norms' means, which the symmetric program has too)
    symmetric_ops = xnnpack_exports("8da4w").report["delegation"]["by_backend"]["XnnpackBackend"]["operators"]
    assert xnn_ops.get("aten_mean_dim") - symmetric_ops.get("aten_mean_dim", 0) == 2 * 4
    assert all(r["not_delegated"] == 0 for r in delegation["operators"]
               if r["op_type"] in ("aten_linear_default", "aten_mean_dim"))


def _operators(pte_path) -> set[str]:
    from llmcore.runtime.pte import read_program_table

    program = read_program_table(pte_path.read_bytes())
    plan = next(p for p in program.execution_plan if p.name == "forward")
    return {op.name for op in plan.operators}


@pytest.mark.parametrize(
    "variant, lookup",
    [
        ("8da4w", "quantized_decomposed::embedding_byte"),  # 8-bit rows by default
        ("8da4w-emb0", "aten::embedding"),
        ("8da4w-emb4", "quantized_decomposed::embedding_4bit"),
    ],
)
def test_embedding_lookup_operator(xnnpack_exports, variant, lookup):
    ops = _operators(xnnpack_exports(variant).pte)
    lookups = {op for op in ops if "embedding" in op}
    assert lookups == {lookup}  # the token table only; the position table is sliced, in fp32
    assert not any(op.startswith("torchao::") for op in ops)  # nothing the runtime lacks


def predicted_size(fp32_bytes: int, embedding_bits: int) -> float:
    """The 8da4w program's size predicted from the fp32 one and the bytes per weight.

    The fp32 program (517 KB) holds the 8 block linears (98,304 weights) in its XNNPACK
    delegates and the tied 257 x 64 table once, for the embedding and the output layer.
    8da4w stores the 8 block linears as int4 with a bf16 scale per 32 (0.5625 bytes a
    weight) and the output layer as int8 with an fp32 scale per row; the embedding reads
    int8 (the default) or packed int4 rows with an fp32 scale per 32 columns, or with
    embedding_bits=0 the fp32 table.
    """
    model = fp32_tiny()
    all_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    output_rows, output_width = model.lm_head.weight.shape
    block_weights = all_weights - output_rows * output_width
    size = fp32_bytes - 4 * block_weights + 0.5625 * block_weights + output_rows * (output_width + 4)
    if embedding_bits:
        rows, width = model.transformer.wte.weight.shape
        size += -4 * rows * width + rows * width * embedding_bits / 8 + rows * (width // 32) * 4
    return size


@pytest.mark.parametrize(
    "variant, bits, ratio", [("8da4w-emb0", 0, 0.42), ("8da4w", 8, 0.33), ("8da4w-emb4", 4, 0.31)]
)
def test_program_size_follows_the_bits(xnnpack_exports, variant, bits, ratio):
    """Within 10% of the prediction (the delegates' per-layer overhead is the rest); the
    ratio to fp32 stays high for so small a model (8da4w, 8-bit table: 0.306 observed) because the
    fp32 position table, the norms and the int8 output layer weigh in."""
    fp32 = xnnpack_exports("fp32").report["outputs"]["pte_bytes"]
    size = xnnpack_exports(variant).report["outputs"]["pte_bytes"]
    expected = predicted_size(fp32, bits)
    assert abs(size - expected) <= 0.1 * expected, f"{variant}: {size} B, predicted {expected:.0f}"
    assert size < ratio * fp32


def test_group_size_option_is_honoured(xnnpack_exports):
    g32 = xnnpack_exports("8da4w").report
    g128 = xnnpack_exports("8da4w-g128").report
    assert g128["quantization"]["options"]["group_size"] == 128
    # Fewer scales: the in=64 layers fall back to one group per row, the in=256 one to 128.
    assert g128["outputs"]["pte_bytes"] < g32["outputs"]["pte_bytes"] - 1_500
    assert g128["delegation"]["by_backend"]["XnnpackBackend"]["operators"]["aten_linear_default"] == N_LINEAR
    program = Program.load(xnnpack_exports("8da4w-g128").pte)
    vs_fp32, = worst_diffs(program, [fp32_tiny()])
    assert vs_fp32 <= 0.2


@pytest.mark.parametrize(
    "options, message",
    [
        ({"group_size": 48}, "multiple of 32"),
        ({"group_size": -32}, "multiple of 32"),
        ({"embedding_bits": 3}, "embedding_bits 3"),
        ({"embedding_bits": 4, "embedding_group_size": 7}, "embedding_group_size 7"),
    ],
)
def test_invalid_options_are_refused(registry, tmp_path, options, message):
    from llmcore.pipeline import export
    from llmcore.recipe import ExportOptions

    out = tmp_path / "bad.pte"
    opts = ExportOptions(
        model="nanogpt", config="tiny", output=str(out), quiet=True,
        plugins=["xnnpack"], quantize="8da4w", quantize_options=options,
    )
    with pytest.raises(LlmcoreError) as info:
        export(opts, registry)
    assert message in info.value.message
    assert info.value.stage == "quantize" and info.value.plugin
    assert not out.exists()


def test_recipe_is_meant_for_xnnpack(registry, tmp_path):
    from llmcore.pipeline import export
    from llmcore.recipe import ExportOptions

    # --plugins none: the portable runtime named (without --plugins a recipe gets the CPU's default list)
    opts = ExportOptions(model="nanogpt", config="tiny", output=str(tmp_path / "p.pte"), quiet=True, quantize="8da4w",
                         plugins=["none"])
    with pytest.raises(LlmcoreError, match="meant for xnnpack"):
        export(opts, registry)


@pytest.mark.parametrize(
    "in_features, requested, expected",
    [
        (768, 32, 32),
        (768, 512, 384),  # GPT-2's 768 with a 512 group: the largest multiple of 32 dividing it
        (3072, 512, 512),
        (64, 128, 0),  # the group would span more than a row: one scale per row
        (96, 64, 32),
        (96, 0, 0),
        (48, 32, None),  # not a multiple of 32: XNNPACK's int4 GEMM cannot take it, stays fp32
        (100, 0, None),
    ],
)
def test_linear_group_fallback(in_features, requested, expected):
    assert linear_group(in_features, requested) == expected


def test_layer_whose_width_is_not_a_multiple_of_32_stays_fp32_and_runs(recipe_defaults):
    """A linear with 48 in-features is left in fp32 (XNNPACK runs it unquantized); the others
    are quantized; the whole program lowers and runs."""
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from torch import nn

    from llmcore_xnnpack.partition import SharedTablePartitioner

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 10)).eval()
    x = torch.randn(3, 64)

    def feed(module, _ids) -> int:
        module(x)
        return len(x)

    quantize_8da4w(model, recipe_defaults, Calibration(token_ids=lambda _: [0], run=feed))
    assert type(model[2]) is nn.Linear and model[2].weight.dtype == torch.float32
    assert type(model[0]).__name__ == "BlockInt4Linear"
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = model(x)
    edge = to_edge_transform_and_lower(
        torch.export.export(model, (x,)),
        partitioner=[SharedTablePartitioner(per_op_mode=False)],
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
    )
    program = edge.to_executorch()
    assert not any("quantized_decomposed" in str(n.target) for n in edge.exported_program().graph.nodes)
    module = Program.load(program.buffer).module
    got = module.run_method("forward", [x])[0]
    assert (got - expected).abs().max().item() < 0.02


def test_unreadable_calibration_text_fails_the_export_in_one_line_and_writes_nothing(tmp_path, registry):
    from llmcore.pipeline import export
    from llmcore.recipe import ExportOptions

    out = tmp_path / "model.pte"
    options = ExportOptions(model="nanogpt", config="tiny", output=str(out), quiet=True, plugins=["xnnpack"],
                            quantize="8da4w", quantize_options={"calibration_text": str(tmp_path / "missing.txt")})
    with pytest.raises(LlmcoreError) as raised:
        export(options, registry)
    message = str(raised.value)
    assert "missing.txt" in message and raised.value.stage == "quantize" and raised.value.plugin
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("other", [{"activation_aware": False, "awq": False}, {"asymmetric": True}])
def test_calibration_text_that_would_not_be_read_is_refused(recipe_defaults, tmp_path, other):
    text = tmp_path / "mine.txt"
    text.write_text("some words", encoding="utf-8")
    with pytest.raises(LlmcoreError, match="calibration_text"):
        quantize_8da4w(fp32_tiny(), {**recipe_defaults, **other, "calibration_text": str(text)})
