"""llmcore.stored.stored_rows: a part of a stored matrix's rows keeps what the loader recorded,
its integers and its reads from the file, the same as those rows of the whole."""

from __future__ import annotations

import torch

from llmcore import stored


def integers(rows: int = 12, cols: int = 64, offsets: bool = True) -> stored.IntegerWeight:
    g = torch.Generator().manual_seed(0)
    return stored.IntegerWeight(
        format="Q4_1", source_name="blk.0.attn_qkv.weight", bits=4, block=32,
        q=torch.randint(-8, 8, (rows, cols), generator=g, dtype=torch.int8),
        scales=torch.rand(rows, cols // 32, generator=g),
        offsets=torch.rand(rows, cols // 32, generator=g) if offsets else None)


def in_file(whole: stored.IntegerWeight) -> tuple[stored.FileWeight, list]:
    """``whole`` as a weight left in its file, and the row slices each read asked for."""
    asked = []

    def read_floats(rows: slice) -> torch.Tensor:
        asked.append(rows)
        return whole.dequantize()[rows].clone()

    return stored.FileWeight("Q4_1", whole.source_name, tuple(whole.q.shape), read_floats, lambda: whole), asked


def test_rows_of_integers_are_those_rows():
    whole = integers()
    part = stored.stored_rows(whole, 4, 8)
    assert torch.equal(part.q, whole.q[4:8]) and torch.equal(part.scales, whole.scales[4:8])
    assert torch.equal(part.offsets, whole.offsets[4:8])
    assert torch.equal(part.dequantize(), whole.dequantize()[4:8])
    assert stored.stored_rows(integers(offsets=False), 0, 4).offsets is None


def test_rows_of_a_weight_in_the_file_are_read_from_it():
    whole = integers()
    form, asked = in_file(whole)
    part = stored.stored_rows(form, 8, 12)
    assert part.shape == (4, 64) and part.has_integers and part.source_name == form.source_name
    assert torch.equal(part.read_floats(slice(1, 3)), whole.dequantize()[9:11])
    assert asked == [slice(9, 11)]  # only those rows read
    assert torch.equal(part.read_floats(slice(None)), whole.dequantize()[8:12])
    assert torch.equal(part.read_integers().q, whole.q[8:12])
    # a part remembered on its own tensor is what a recipe finds there
    weight = torch.empty(4, 64, device="meta")
    stored.remember(weight, part)
    assert stored.in_file(weight) and torch.equal(stored.stored_form(weight).scales, whole.scales[8:12])


def test_a_format_name_stays_as_it_is():
    name = stored.StoredFormat("Q6_K", "output.weight")
    assert stored.stored_rows(name, 0, 3) is name


def test_a_weights_stored_bytes_are_read_by_rows():
    """A loader's :attr:`FileWeight.read_blocks` (the file's bytes, for a backend that computes
    the format as it is): a part of the rows reads those rows' bytes; no reader, no bytes."""
    blocks = torch.arange(6 * 2 * 210, dtype=torch.int32).to(torch.uint8).view(6, 2, 210)
    form = stored.FileWeight("Q6_K", "output.weight", (6, 512), lambda rows: torch.zeros(6, 512)[rows],
                             read_blocks=lambda: blocks)
    weight = torch.empty(6, 512, device="meta")
    stored.remember(weight, form)
    assert torch.equal(stored.stored_blocks(weight), blocks)
    part = torch.empty(2, 512, device="meta")
    stored.remember(part, stored.stored_rows(form, 3, 5))
    assert torch.equal(stored.stored_blocks(part), blocks[3:5])
    without = torch.empty(6, 512, device="meta")
    stored.remember(without, stored.FileWeight("Q5_0", "output.weight", (6, 512), form.read_floats))
    assert stored.stored_blocks(without) is None and stored.stored_blocks(torch.zeros(2)) is None
