"""The calibration a calibrated source recipe receives (llmcore.pipeline.quantize.calibration_for):
which text it reads, how it calls the model, and that the model's buffers come back unchanged
(the exported program takes them as its initial KV cache)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmcore.errors import LlmcoreError
from llmcore.pipeline.quantize import CALIBRATION_TEXT, calibration_for


class CacheWriter(nn.Module):
    """Records each call and writes into its buffer, as a KV cache does."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.full((16,), 3.0))
        self.calls: list[tuple[list[int], int]] = []

    def forward(self, tokens, pos=None):
        start = 0 if pos is None else int(pos[0])
        self.calls.append((tokens[0].tolist(), start))
        self.cache[start:start + tokens.shape[1]] = tokens[0].float()
        return tokens.float()


def test_built_in_text_is_read_and_encoded():
    seen = []
    calibration = calibration_for(lambda text: seen.append(text) or [1, 2, 3], 16, 16, True, "r")
    assert calibration.token_ids("") == [1, 2, 3]
    assert seen == [CALIBRATION_TEXT.read_text(encoding="utf-8")] and len(seen[0].split()) > 300


def test_a_text_file_of_ones_own(tmp_path):
    text = tmp_path / "mine.txt"
    text.write_text("words of my own", encoding="utf-8")
    calibration = calibration_for(lambda t: [len(t)], 16, 16, True, "r")
    assert calibration.token_ids(str(text)) == [len("words of my own")]


@pytest.mark.parametrize("content", [None, b"\xff\xfe\xfa", b""])
def test_unreadable_or_empty_text_is_one_line_naming_recipe_stage_and_fix(tmp_path, content):
    path = tmp_path / "calibration.txt"
    if content is not None:
        path.write_bytes(content)
    calibration = calibration_for(lambda t: [ord(c) for c in t], 16, 16, True, "8da4w")
    with pytest.raises(LlmcoreError) as raised:
        calibration.token_ids(str(path))
    message = str(raised.value)
    assert "8da4w" in message and "calibration" in message and "\n" not in message.strip()
    assert raised.value.stage == "quantize" and raised.value.fix


def test_run_feeds_chunks_at_their_positions_up_to_the_context_and_restores_buffers():
    module = CacheWriter()
    assert calibration_for(lambda t: [], 10, 4, True, "r").run(module, list(range(100, 114))) == 10
    assert module.calls == [([100, 101, 102, 103], 0), ([104, 105, 106, 107], 4), ([108, 109], 8)]
    assert torch.equal(module.cache, torch.full((16,), 3.0))


def test_run_without_a_cache_is_one_call_from_the_start():
    module = CacheWriter()
    assert calibration_for(lambda t: [], 10, 10, False, "r").run(module, list(range(14))) == 10
    assert module.calls == [(list(range(10)), 0)]
    assert torch.equal(module.cache, torch.full((16,), 3.0))
