"""The faster lowering (llmcore_xnnpack.lowering) writes the program ExecuTorch would.

Authority: the same export with both shortcuts turned off, i.e. ExecuTorch's own
decomposition path and every XNNPACK preprocess pass on every partition. The `.pte`
files must be identical byte for byte, so every delegate, every constant and the
graph around them are what they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import pytest

from llmcore.testing.conformance import export_tiny
from llmcore_xnnpack import lowering

CASES = [
    ("llama", "8da4w", 3),
    ("llama", None, 3),
    ("nanogpt", "int8-dynamic", 3),
]


def _deeper_tiny(monkeypatch, family: str, layers: int) -> None:
    """The tiny config with ``layers`` layers: two give no partition that repeats."""
    if family == "llama":
        from llmcore_llama import config

        monkeypatch.setitem(config.CONFIGS, "tiny", dataclasses.replace(config.CONFIGS["tiny"], n_layers=layers))
    else:
        from llmcore_nanogpt import model

        monkeypatch.setitem(model.CONFIGS, "tiny", dataclasses.replace(model.CONFIGS["tiny"], n_layer=layers))


def _export(tmp_path, name: str, family: str, quantize):
    out = tmp_path / name / f"{family}.pte"
    out.parent.mkdir()
    return export_tiny("xnnpack", family, quantize=quantize, cache=False, output=out)


def _ops_to_not_decompose_unchanged(ep, ops, keep):
    return ops, keep


@pytest.mark.parametrize("family,quantize,layers", CASES)
def test_same_program_as_executorch_lowering(tmp_path, monkeypatch, caplog, family, quantize, layers):
    _deeper_tiny(monkeypatch, family, layers)
    with caplog.at_level(logging.INFO, logger="llmcore_xnnpack.lowering"):
        fast = _export(tmp_path, "fast", family, quantize)
    summary = [r.getMessage() for r in caplog.records if "preprocess passes skipped" in r.getMessage()]
    assert summary, "the remembered pass manager did not run"
    skipped = int(summary[0].split("; ")[1].split()[0])
    assert skipped > 0, summary[0]

    with monkeypatch.context() as m:
        m.setattr(lowering, "ops_to_not_decompose", _ops_to_not_decompose_unchanged)
        m.setattr(lowering, "remembered_passes", contextlib.nullcontext)
        reference = _export(tmp_path, "reference", family, quantize)

    fast_bytes = fast.pte.read_bytes()
    reference_bytes = reference.pte.read_bytes()
    assert len(fast_bytes) == len(reference_bytes)
    assert fast_bytes == reference_bytes
