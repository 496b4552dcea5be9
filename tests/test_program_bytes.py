"""A program file's bytes for the bindings: the file's content, as a ``bytes`` object, with
the data on a 2 MiB boundary (llmcore.runtime.program_bytes), and the mapping given back only when
nothing refers to them."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest

from llmcore.runtime import program_bytes
from llmcore.runtime.program_bytes import read_program_bytes

pytestmark = pytest.mark.skipif(
    sys.implementation.name != "cpython" or not sys.platform.startswith("linux"),
    reason="the aligned bytes are made on Linux CPython only",
)


def address(data: bytes) -> int:
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value


@pytest.mark.parametrize("size", [0, 1, 4097, (5 << 20) + 3])
def test_the_bytes_are_the_file_on_a_huge_page_boundary(tmp_path, size):
    path = tmp_path / "program.pte"
    path.write_bytes(os.urandom(size))
    memory = read_program_bytes(path)
    assert type(memory.data) is bytes and memory.aligned
    assert memory.data == path.read_bytes() and len(memory.data) == size
    assert address(memory.data) % (2 << 20) == 0
    assert memory.data[size:] == b"" and ctypes.string_at(address(memory.data) + size, 1) == b"\0"
    assert hash(memory.data) == hash(path.read_bytes())  # a bytes object in every respect


def test_the_mapping_goes_with_the_last_reference(tmp_path):
    """Unmapped when its holder goes and nothing else refers to the bytes; kept for the
    process when something does, so that reference never points at unmapped memory."""
    path = tmp_path / "program.pte"
    path.write_bytes(os.urandom(3 << 20))
    kept = len(program_bytes._KEPT_MAPPINGS)

    memory = read_program_bytes(path)
    del memory
    assert len(program_bytes._KEPT_MAPPINGS) == kept

    memory = read_program_bytes(path)
    still_used = memory.data
    del memory
    assert len(program_bytes._KEPT_MAPPINGS) == kept + 1
    assert program_bytes._KEPT_MAPPINGS[-1].closed is False
    assert still_used == path.read_bytes()


def test_an_unknown_layout_reads_plain_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(program_bytes, "_layout_is_known", lambda: False)
    path = tmp_path / "program.pte"
    path.write_bytes(os.urandom(4097))
    memory = read_program_bytes(path)
    assert not memory.aligned and memory.data == path.read_bytes()


def test_the_layout_is_recognised_here():
    assert program_bytes._layout_is_known()


def test_a_program_runs_from_the_aligned_bytes(exports):
    """``Program.load`` runs a file from the aligned bytes and computes what the same
    program run from a plain ``bytes`` buffer computes."""
    import torch

    from llmcore.runtime import Program

    pte = exports("xnnpack").pte
    program = Program.load(pte)
    assert program._data.aligned and address(program._data.data) % (2 << 20) == 0
    tokens = list(range(3, 30))
    from_buffer = Program.load(open(pte, "rb").read())
    assert torch.equal(program.logits(tokens, 0), from_buffer.logits(tokens, 0))
    kept = len(program_bytes._KEPT_MAPPINGS)
    del program
    assert len(program_bytes._KEPT_MAPPINGS) == kept  # nothing but the program referred to them
