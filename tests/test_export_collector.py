"""The cycle collector during an export: rarer automatic passes while it runs, Python's
settings back afterwards, whether the export succeeds or fails."""

from __future__ import annotations

import gc

import pytest

from llmcore.errors import LlmcoreError


def _tiny_export(tmp_path, monkeypatch, fail: bool = False):
    from llmcore.pipeline import EXPORT_GC_THRESHOLD, capture, export
    from llmcore.recipe import ExportOptions

    during = []
    original = capture.capture

    def watched(*args, **kwargs):
        during.append((gc.get_threshold()[0], gc.get_freeze_count()))
        if fail:
            raise LlmcoreError("stopped by the test", stage="export")
        return original(*args, **kwargs)

    monkeypatch.setattr(capture, "capture", watched)
    options = ExportOptions(model="nanogpt", config="tiny", plugins=["xnnpack"], output=str(tmp_path / "o.pte"),
                            quiet=True, max_seq_len=32)
    if fail:
        with pytest.raises(LlmcoreError):
            export(options)
    else:
        export(options)
    return during, EXPORT_GC_THRESHOLD


@pytest.mark.parametrize("fail", [False, True])
def test_collector_is_tuned_during_an_export_and_restored_after(tmp_path, monkeypatch, fail):
    before = gc.get_threshold()
    during, threshold = _tiny_export(tmp_path, monkeypatch, fail)
    assert during and during[0][0] == max(before[0], threshold) and during[0][1] > 0  # imports frozen
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    assert (tmp_path / "o.pte").exists() != fail
