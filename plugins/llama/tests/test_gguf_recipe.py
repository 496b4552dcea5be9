"""The ``gguf`` recipe end to end: a quantized GGUF exported with ``--plugins xnnpack`` and no
``--quantize`` keeps the file's own integers.

The checkpoint is the tiny random Llama of ``llama_testutils`` (dim 64, FFN 160: every
in-features a multiple of 32), its block linears written as Q4_1 (kept as int4 plus offsets)
and its output layer as Q8_0 (rounded to int8 per channel) by ``gguf.quants.quantize``.
Authorities:

* the export's own parity check (the program against the recipe's quantized eager module):
  top-1 agreement 1.0;
* the eager model built from the *dequantized* GGUF (``load_gguf``, i.e. ``gguf.quants``'
  values): the program differs from it by the recipe's int8 per-token activations, the
  f16 -> bf16 rounding of the 4-bit scales and the Q8_0 output layer's int8 re-rounding.
  Observed max |logit diff| 0.021 over prefills of 1, 9 and 30 tokens and 6 decode steps
  (logits span about +-1.5; 0.007 of it without activation quantization, 0.024 with a Q4_1
  output layer); bound 0.06, and the same argmax everywhere. (The parity check's own
  max |diff| against the quantized eager module was 0.0.)
"""

from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from llama_testutils import TINY, meta_state_dict, random_model, tokens, write_gguf
from llmcore.errors import LlmcoreError
from llmcore.records import LoadOptions
from llmcore.runtime import Program
from llmcore_llama import loaders
from llmcore_llama.tokenization import tiny_tokenizer

BOUND = 0.06
LINEARS = [f"layers.{i}.{w}.weight" for i in range(TINY.n_layers) for w in (
    "attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
    "feed_forward.w3")]
TYPES = {**{name: Q.Q4_1 for name in LINEARS}, "output.weight": Q.Q8_0}


def write_checkpoint(folder, types, file="q.gguf"):
    assert TINY.dim % 32 == 0 and TINY.hidden_dim % 32 == 0
    write_gguf(folder / file, meta_state_dict(random_model(TINY, std=0.05)), TINY, types=types)
    (folder / "tokenizer.json").write_text(tiny_tokenizer(TINY.vocab_size).json_text)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gguf-recipe"), TYPES)


def run_export(checkpoint, name: str, file="q.gguf", **fields):
    from llmcore.pipeline import export
    from llmcore.recipe import ExportOptions

    options = ExportOptions(
        model="llama", checkpoint=str(checkpoint / file), tokenizer=str(checkpoint / "tokenizer.json"),
        plugins=["xnnpack"], output=str(checkpoint / name / "model.pte"), quiet=True, **fields,
    )
    (checkpoint / name).mkdir()
    return export(options)


@pytest.fixture(scope="module")
def gguf_export(checkpoint):
    return run_export(checkpoint, "default")


def test_quantized_gguf_gets_the_gguf_recipe_by_default(gguf_export):
    report = gguf_export.report
    assert report["options"]["quantize"] is None
    assert report["quantization"]["recipe"] == "gguf"
    assert report["parity"]["top1_agreement"] == 1.0
    assert json.loads(gguf_export.report_path.read_text())["quantization"]["recipe"] == "gguf"
    assert report["delegation"]  # lowered to XNNPACK


def worst_logit_diff(pte, checkpoint, near_tie: float = 0.0) -> float:
    """Max |logit diff| of the program against the dequantized GGUF's eager model, over
    prefills of 1, 9 and 30 tokens and 6 decode steps; the argmax must agree wherever the
    reference's top two logits are more than ``near_tie`` apart."""
    reference = loaders.load_gguf(checkpoint / "q.gguf", LoadOptions()).module.eval()
    program = Program.load(pte)
    assert program.use_kv_cache
    seq = tokens(36, TINY.vocab_size, seed=2)[0].tolist()
    # prefills at position 0, the last of which the decode steps continue
    cases = [(seq[:n], 0, n) for n in (1, 9, 30)] + [([seq[p]], p, p + 1) for p in range(30, 36)]
    worst = 0.0
    for fed, pos, upto in cases:
        got = program.logits(fed, pos)
        with torch.no_grad():
            expected = reference(torch.tensor([seq[:upto]]))[0]
        worst = max(worst, float((got - expected).abs().max()))
        top2 = expected.topk(2).values
        if float(top2[0] - top2[1]) > near_tie:
            assert int(got.argmax()) == int(expected.argmax()), f"argmax differs after {upto} tokens"
    return worst


def test_program_logits_close_to_the_dequantized_gguf(gguf_export, checkpoint):
    worst = worst_logit_diff(gguf_export.pte, checkpoint)
    print(f"max |logit diff| vs the dequantized GGUF: {worst:.4g}")
    assert worst <= BOUND


def test_outlier_split_program(gguf_export, checkpoint):
    """``outlier_split=true`` (two int8 rows per token) reaches the default recipe through
    --quantize-option, keeps one delegate per layer, and stays within the same bound of the
    dequantized GGUF (observed 0.021 -> 0.020: this random model's activations have no
    outliers for the split to isolate; test_qlinear checks the gain on activations that do).
    One decode step here has its top two logits 0.0045 apart, less than either program's
    error, so the argmax is compared only where the reference is not that close to a tie."""
    split = run_export(checkpoint, "split", quantize_options={"outlier_split": True})
    assert split.report["parity"]["top1_agreement"] == 1.0
    assert split.report["quantization"]["options"]["outlier_split"] is True
    delegates = lambda r: r["delegation"]["delegated_subgraphs"]  # noqa: E731
    assert delegates(split.report) == delegates(gguf_export.report)
    assert worst_logit_diff(split.pte, checkpoint, near_tie=2 * BOUND) <= BOUND


def test_quantize_none_keeps_floats(checkpoint):
    result = run_export(checkpoint, "none", quantize="none")
    assert result.report["quantization"] is None
    assert result.report["parity"]["top1_agreement"] == 1.0


def test_gguf_recipe_refuses_a_float_checkpoint(tmp_path):
    from llmcore.pipeline import export
    from llmcore.recipe import ExportOptions

    out = tmp_path / "float.pte"
    with pytest.raises(LlmcoreError) as e:
        export(ExportOptions(model="llama", config="tiny", plugins=["xnnpack"], quantize="gguf",
                             output=str(out), quiet=True))
    assert e.value.stage == "quantize"
    assert "stores no quantized matrices" in e.value.message
    assert not out.exists() and not list(tmp_path.iterdir())


def test_quantize_options_without_a_recipe_are_refused(tmp_path):
    """A float checkpoint gets no recipe by default: options for one are refused by name, not
    dropped (an ``outlier_split=true`` that silently did nothing would mislead)."""
    from llmcore.pipeline import export
    from llmcore.recipe import ExportOptions

    out = tmp_path / "float.pte"
    with pytest.raises(LlmcoreError) as e:
        export(ExportOptions(model="llama", config="tiny", plugins=["xnnpack"], output=str(out), quiet=True,
                             quantize_options={"outlier_split": True}))
    assert e.value.stage == "quantize"
    assert "outlier_split" in e.value.message and "--quantize 8da4w" in e.value.fix
    assert not out.exists() and not list(tmp_path.iterdir())


def test_q4_0_gguf_exports(tmp_path):
    """gguf.quants writes Q4_0 with d = max / -8, negative for about half the blocks, which
    XNNPACK refuses as scales: BlockInt4Linear rewrites such blocks exactly (|d|*(-q-1) + |d|)."""
    result = run_export(write_checkpoint(tmp_path, {name: Q.Q4_0 for name in LINEARS}), "q4_0")
    assert result.report["quantization"]["recipe"] == "gguf"
    assert result.report["parity"]["top1_agreement"] == 1.0


def embedding_ops(pte) -> set[str]:
    """The names of the lookup operators the program's forward calls."""
    from llmcore.runtime.pte import read_program_table

    plan = next(p for p in read_program_table(pte.read_bytes()).execution_plan if p.name == "forward")
    return {op.name for op in plan.operators if "embedding" in op.name}


def stored_token_table(folder):
    """The GGUF's token table as ``gguf.quants`` dequantizes it, and the loader's
    :class:`~llmcore.stored.IntegerWeight` of it."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    stored = next(t for t in GGUFReader(folder / "q.gguf").tensors if t.name == "token_embd.weight")
    table = torch.from_numpy(dequantize(stored.data, stored.tensor_type).reshape(TINY.vocab_size, TINY.dim).copy())
    loaded = loaders.load_gguf(folder / "q.gguf", LoadOptions(stored_integers=True))
    return table, loaded.stored_weights["tok_embeddings.weight"].read_integers()


# a token table's GGUF type -> the lookup it becomes, its operator, the least share of the fp32
# table's bytes the program saves against a float table, and how far its values may lie from
# gguf.quants' (relative to the table's largest)
STORED_TABLES = {
    # int8 rows and per-32 scales: about three quarters, the file's values exactly
    "Q8_0": ("StoredByteEmbedding", "quantized_decomposed::embedding_byte", 0.6, 0.0),
    # an untied model's, as llama-quantize writes it: two values a byte and float16 scales,
    # more than 80% (int8 rows of the same integers, as until 2026-12-06, saved 72%: a byte a
    # value and a 4-byte scale a block), exactly
    "Q4_0": ("StoredNibbleEmbedding", "quantized_decomposed::embedding_4bit", 0.8, 0.0),
    # with its minima as float32 zero points beside float32 scales: 81% (int8 rows: 72%), the
    # values (q - zero point) * scale, a float rounding from the file's
    "Q4_1": ("StoredNibbleEmbedding", "quantized_decomposed::embedding_4bit", 0.78, 1e-6),
}


@pytest.mark.parametrize("kind", sorted(STORED_TABLES))
def test_a_stored_token_table_keeps_its_integers(tmp_path, kind):
    """A token table stored as Q8_0, Q4_0 or Q4_1 goes into the program as its integers and
    scales, looked up by ExecuTorch's quantized embedding kernel for them: the eager lookup
    gives ``gguf.quants``' dequantized rows (exactly, or within float rounding where offsets
    become zero points), the program stays within the bound of the dequantized GGUF, and it is
    smaller than the same export with the table in fp32 by the share STORED_TABLES gives."""
    from llmcore_xnnpack import torchao_quant

    lookup_class, operator, least_saved, tolerance = STORED_TABLES[kind]
    folder = write_checkpoint(tmp_path, {**TYPES, "tok_embeddings.weight": getattr(Q, kind)})
    result = run_export(folder, "emb")
    assert embedding_ops(result.pte) == {operator}
    assert result.report["parity"]["top1_agreement"] == 1.0
    assert worst_logit_diff(result.pte, folder) <= BOUND

    table, form = stored_token_table(folder)
    lookup = (torchao_quant.StoredByteEmbedding(form.q, form.scales) if lookup_class == "StoredByteEmbedding"
              else torchao_quant.StoredNibbleEmbedding(form.q, form.scales, form.offsets))
    ids = torch.tensor([[0, 5, TINY.vocab_size - 1, 5]])
    assert torch.equal(lookup(ids)[0], lookup.weight_values()[ids[0]])
    assert float((lookup.weight_values() - table).abs().max()) <= tolerance * float(table.abs().max())

    (tmp_path / "f32").mkdir()
    floats = run_export(write_checkpoint(tmp_path / "f32", TYPES), "f32")
    saved = floats.pte.stat().st_size - result.pte.stat().st_size
    table_bytes = TINY.vocab_size * TINY.dim * 4
    assert least_saved * table_bytes < saved < table_bytes


def test_a_4_bit_tables_flat_blocks_keep_their_offset():
    """A block whose scale is 0 (every value its offset: a Q4_K block of equal values) cannot
    be a zero point ``-offset / scale``; it is held as ``-8 * (-offset / 8)``, exactly, and the
    other blocks within float rounding of ``scale * q + offset``."""
    from llmcore_xnnpack.torchao_quant import StoredNibbleEmbedding

    generator = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (6, 64), dtype=torch.int8, generator=generator)
    scales = torch.randn(6, 2, generator=generator) * 0.01
    offsets = torch.randn(6, 2, generator=generator) * 0.05
    scales[1, 1] = 0.0  # a flat block
    scales[4, 0] = offsets[4, 0] = 0.0  # a block of zeros
    exact = (q.float().view(6, 2, 32) * scales.unsqueeze(-1) + offsets.unsqueeze(-1)).view(6, 64)
    values = StoredNibbleEmbedding(q, scales, offsets).weight_values()
    assert torch.equal(values[1, 32:], exact[1, 32:]) and torch.equal(values[4, :32], torch.zeros(32))
    assert float((values - exact).abs().max()) <= 1e-6 * float(exact.abs().max())


def test_weights_rounded_again_are_reported_once_per_format(tmp_path, caplog):
    """A file whose every linear is Q8_0 (113 of them in Llama-3.2-1B's shape) gets one
    warning for them, with the count and the worst error, not one a weight; a single one
    (the fixture's Q8_0 output layer) is named."""
    import logging

    folder = write_checkpoint(tmp_path, {**{name: Q.Q8_0 for name in LINEARS}, "output.weight": Q.Q8_0})
    with caplog.at_level(logging.WARNING, logger="llmcore_xnnpack.recipes"):
        result = run_export(folder, "q8_0")
    assert result.report["parity"]["top1_agreement"] == 1.0
    again = [r.getMessage() for r in caplog.records if "rounded again" in r.getMessage()]
    assert len(again) == 1, again
    assert again[0].startswith(f"gguf: {len(LINEARS) + 1} Q8_0 weights are rounded again, to int8 per channel")
    assert "weight error at most" in again[0]

    caplog.clear()
    (tmp_path / "one").mkdir()
    with caplog.at_level(logging.WARNING, logger="llmcore_xnnpack.recipes"):
        run_export(write_checkpoint(tmp_path / "one", TYPES), "one")
    again = [r.getMessage() for r in caplog.records if "rounded again" in r.getMessage()]
    assert len(again) == 1 and again[0].startswith("gguf: output.weight (Q8_0) is rounded again"), again
