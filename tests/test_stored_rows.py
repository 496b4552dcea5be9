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
