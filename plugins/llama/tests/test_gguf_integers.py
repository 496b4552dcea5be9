"""The integers a quantized GGUF stores (``quants.integer_weight``), against ``gguf.quants``.

The authority is the ``gguf`` package's own ``gguf.quants.dequantize`` of the same raw bytes:
``IntegerWeight.dequantize()`` (``scales * q + offsets`` per block of 32) must give its values
to fp32 rounding. Q8_0, Q4_0 and Q4_1 bytes are written by ``gguf.quants.quantize`` from random
floats; Q4_K, which that package cannot write, comes as random but well-formed blocks
(``llama_testutils.random_k_blocks``: random quants and six-bit scales, small f16 d / dmin).
"""

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from llama_testutils import TINY, gguf_name, meta_state_dict, random_k_blocks, random_model, write_gguf
from llmcore.records import LoadOptions
from llmcore.stored import FileWeight, IntegerWeight, StoredFormat
from llmcore_llama import loaders, quants

ROWS, COLS = 64, 256
# type -> (bits, has offsets, integer range)
EXPECTED = {
    Q.Q8_0: (8, False, (-128, 127)),
    Q.Q4_0: (4, False, (-8, 7)),
    Q.Q4_1: (4, True, (-8, 7)),
    Q.Q4_K: (4, True, (-8, 7)),
}


def raw_blocks(qt, rows=ROWS, cols=COLS, seed=0) -> np.ndarray:
    if qt == Q.Q4_K:  # gguf.quants cannot quantize to Q4_K
        return random_k_blocks(qt, rows, cols, seed=seed)
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, cols)).astype(np.float32) * 0.3 + 0.05  # nonzero mean: Q4_1's m
    return gq.quantize(values, qt)


def authority(raw: np.ndarray, qt) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gq.dequantize(raw, qt), dtype=np.float32)).reshape(ROWS, COLS)


@pytest.mark.parametrize("qt", list(EXPECTED), ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_integers_give_gguf_s_values(qt, seed):
    """dequantize() of the integer form == gguf.quants.dequantize(raw) to fp32 rounding."""
    raw = raw_blocks(qt, seed=seed)
    form = quants.integer_weight(raw, int(qt), (ROWS, COLS), "blk.0.ffn_up.weight")
    bits, has_offsets, (lo, hi) = EXPECTED[qt]
    assert isinstance(form, IntegerWeight)
    assert form.format == qt.name and form.source_name == "blk.0.ffn_up.weight"
    assert form.bits == bits and form.block == 32
    assert form.q.dtype == torch.int8 and form.q.shape == (ROWS, COLS)
    assert form.scales.dtype == torch.float32 and form.scales.shape == (ROWS, COLS // 32)
    assert (form.offsets is not None) == has_offsets
    if has_offsets:
        assert form.offsets.dtype == torch.float32 and form.offsets.shape == (ROWS, COLS // 32)
    assert lo <= int(form.q.min()) and int(form.q.max()) <= hi
    if bits == 4:  # all 16 nibble values occur in 16k random quants: the full [-8, 7] is used
        assert int(form.q.min()) == -8 and int(form.q.max()) == 7

    expected = authority(raw, qt)
    got = form.dequantize()
    assert got.shape == (ROWS, COLS) and got.dtype == torch.float32
    worst = float((got - expected).abs().max())
    assert worst <= 1e-6 * float(expected.abs().max()), f"{qt.name}: max |diff| {worst:.3g}"
    # the fast dequantizer of the loader agrees as well (it is bit-exact with gguf, see test_llama_gguf)
    assert torch.equal(quants.dequantize(raw, int(qt), (ROWS, COLS)), expected)


@pytest.mark.parametrize("qt", list(EXPECTED), ids=lambda t: t.name)
def test_a_file_s_rows_are_read_a_slice_at_a_time_to_the_same_integers(qt, monkeypatch):
    """A tensor in a file (rows of bytes) is decoded a few rows at a time, a last short slice
    included: the same integers, scales and offsets as one read of all its bytes."""
    raw = raw_blocks(qt, seed=2)
    whole = quants.integer_weight(raw.reshape(-1), int(qt), (ROWS, COLS), "t")
    monkeypatch.setattr(quants, "_INTEGER_ROWS", 3)
    by_rows = quants.integer_weight(raw.reshape(ROWS, -1), int(qt), (ROWS, COLS), "t")
    assert ROWS % 3 and torch.equal(by_rows.q, whole.q) and torch.equal(by_rows.scales, whole.scales)
    assert (whole.offsets is None and by_rows.offsets is None) or torch.equal(by_rows.offsets, whole.offsets)


def test_symmetric_types_are_exact():
    """Q8_0 and Q4_0 have no offsets: d * q is one fp32 product, the same as gguf's."""
    for qt in (Q.Q8_0, Q.Q4_0):
        raw = raw_blocks(qt, seed=3)
        assert torch.equal(quants.integer_weight(raw, int(qt), (ROWS, COLS), "w").dequantize(), authority(raw, qt))


def test_q4_1_integers_are_the_nibbles_minus_8():
    """Q4_1 block by hand: f16 d, f16 m, 16 bytes of nibbles (low nibbles = values 0..15)."""
    d, m = np.float16(0.125), np.float16(-0.75)
    u = np.arange(32, dtype=np.uint8) % 16
    block = np.concatenate([np.frombuffer(np.array([d, m], np.float16).tobytes(), np.uint8),
                            (u[:16] | (u[16:] << 4)).astype(np.uint8)])
    form = quants.integer_weight(block.reshape(1, 20), int(Q.Q4_1), (1, 32), "w")
    assert form.q[0].tolist() == (u.astype(np.int64) - 8).tolist()
    assert float(form.scales[0, 0]) == 0.125 and float(form.offsets[0, 0]) == -0.75 + 8 * 0.125
    assert torch.equal(form.dequantize()[0], torch.from_numpy(0.125 * u.astype(np.float32) - 0.75))


@pytest.mark.parametrize("qt", [Q.Q6_K, Q.Q5_0, Q.F16])
def test_types_without_integer_form_give_their_name(qt):
    cols = 256
    if qt == Q.Q6_K:
        raw = random_k_blocks(qt, 4, cols)
    elif qt == Q.F16:
        raw = np.zeros((4, cols), np.float16)
    else:
        raw = gq.quantize(np.ones((4, cols), np.float32), qt)
    form = quants.integer_weight(raw, int(qt), (4, cols), "output.weight")
    assert form == StoredFormat(qt.name, "output.weight")


def test_one_dimensional_tensors_have_no_integer_form():
    raw = gq.quantize(np.ones(64, np.float32), Q.Q8_0)
    assert quants.integer_weight(raw, int(Q.Q8_0), (64,), "x") == StoredFormat("Q8_0", "x")


def test_loader_leaves_quantized_matrices_in_the_file(tmp_path):
    """load_gguf keeping integers: each quantized 2-D tensor stays in the file (a meta
    parameter and a FileWeight), whose floats, read whole or a few rows at a time, are the
    weights a float load gives, and whose integers dequantize to them; Q5_0 has floats only;
    float tensors are loaded as they are."""
    sd = meta_state_dict(random_model(TINY, std=0.05))
    types = {
        "layers.0.attention.wq.weight": Q.Q4_0,  # rotary rows: the file keeps HF's order
        "layers.0.attention.wo.weight": Q.Q4_1,
        "layers.0.feed_forward.w1.weight": Q.Q8_0,
        "layers.0.feed_forward.w2.weight": Q.Q5_0,
        "layers.1.attention.wk.weight": Q.F16,
    }
    write_gguf(tmp_path / "m.gguf", sd, TINY, types=types)
    lm = loaders.load_gguf(tmp_path / "m.gguf", LoadOptions(stored_integers=True))
    floats = loaders.load_gguf(tmp_path / "m.gguf", LoadOptions(stored_integers=False)).module.state_dict()
    assert set(lm.stored_weights) == set(types) - {"layers.1.attention.wk.weight"}
    params = lm.module.state_dict()
    assert not params["layers.1.attention.wk.weight"].is_meta
    for name, qt in types.items():
        form = lm.stored_weights.get(name)
        if qt == Q.F16:
            continue
        w = floats[name]
        assert isinstance(form, FileWeight) and params[name].is_meta, name
        assert form.format == qt.name and form.source_name == gguf_name(name)
        assert form.shape == tuple(w.shape)
        assert torch.equal(form.read_floats(slice(None)), w), name
        assert torch.equal(form.read_floats(slice(5, 21)), w[5:21]), name  # rows, in Meta's order
        integers = form.read_integers() if form.has_integers else None
        if qt == Q.Q5_0:
            assert integers is None
            continue
        assert isinstance(integers, IntegerWeight)
        assert float((integers.dequantize() - w).abs().max()) <= 1e-6 * float(w.abs().max()), name


def test_weights_left_in_the_file_are_read_when_no_recipe_keeps_them(tmp_path):
    """stored.materialize reads every parameter still in the file as the float load does
    (a tied table once), and the module then computes what the float-loaded one does."""
    from llmcore import stored

    sd = meta_state_dict(random_model(TINY, std=0.05))
    types = {name: Q.Q4_0 for name in sd if name.endswith("weight") and sd[name].dim() == 2}
    write_gguf(tmp_path / "m.gguf", sd, TINY, types=types)
    lm = loaders.load_gguf(tmp_path / "m.gguf", LoadOptions(stored_integers=True))
    stored.attach(lm.module, lm.stored_weights)
    names = stored.materialize(lm.module)
    assert set(names) >= set(types) - {"output.weight"}
    expected = loaders.load_gguf(tmp_path / "m.gguf", LoadOptions(stored_integers=False)).module
    tokens = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.equal(lm.module(tokens), expected(tokens))


def _mapped_kib(path) -> int:
    """This process's resident KiB of the mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = len(fields) >= 6 and fields[-1] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_a_tensor_s_file_pages_go_a_slice_at_a_time_as_its_integers_are_read(tmp_path, monkeypatch):
    """Reading a quantized matrix's integers from the file lets each slice's file pages go
    once it is decoded: mapped pages count in the process's resident memory, and Gemma-3-1B's
    Q8_0 table (321 MB) was all resident beside its integers at the export's peak. The table
    here is 68 MiB, 16 slices of 4.25 MiB (the page cache may map a file in folios of up to
    2 MiB: the bound allows two slices and two folios)."""
    import gguf

    from llmcore_llama.testing import finish_gguf

    rows, cols = 65536, 1024
    blocks = np.random.default_rng(0).integers(0, 256, (rows, cols // 32, 34), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # each block's scale
    path = tmp_path / "table.gguf"
    finish_gguf(gguf.GGUFWriter(str(path), "llama"), {"token_embd.weight": (Q.Q8_0, blocks.reshape(rows, -1))})
    g = loaders.GGUFFile(path)
    (t,) = g.tensors
    resident = []  # the mapping's resident KiB each time pages are let go, just before
    drop = g.drop_pages

    def recording_drop(tensor, rows=None):
        resident.append(_mapped_kib(path))
        drop(tensor, rows)

    monkeypatch.setattr(g, "drop_pages", recording_drop)
    form = loaders.file_weight(g, t, int(Q.Q8_0), t.name, cols, rows).read_integers()
    assert torch.equal(form.q, torch.from_numpy(blocks[:, :, 2:].reshape(rows, cols).view(np.int8)))
    assert bool((form.scales == float(np.float16(0.01))).all())
    slices = rows // quants._INTEGER_ROWS
    slice_kib = quants._INTEGER_ROWS * cols // 32 * 34 / 1024
    assert slices >= 8 and len(resident) == slices + 1  # each slice, then the whole tensor
    assert max(resident) <= 2 * slice_kib + 4096, (max(resident), slice_kib)
    assert _mapped_kib(path) <= 2048
