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


def test_calibration_calls_stay_short_with_a_cache():
    """With a KV cache, calibration feeds at most CALIBRATION_CALL_TOKENS per call (the
    logits of one long call were the quantize stage's peak), at consecutive positions."""
    from llmcore.pipeline.quantize import CALIBRATION_CALL_TOKENS

    module = CacheWriter()
    module.cache = torch.zeros(400)
    ids = list(range(300))
    assert calibration_for(lambda t: [], 400, 1024, True, "r").run(module, ids) == 300
    assert [len(tokens) for tokens, _ in module.calls] == [CALIBRATION_CALL_TOKENS, CALIBRATION_CALL_TOKENS, 44]
    assert [pos for _, pos in module.calls] == [0, CALIBRATION_CALL_TOKENS, 2 * CALIBRATION_CALL_TOKENS]
    assert not module.cache.any()  # zeroed again, as it started


class WeightsAndCaches(nn.Module):
    """Integer weights (buffers, as a quantized layer's), a float scale, a zero KV cache and
    a non-zero float state; ``write_weights`` makes forward write the integer buffer."""

    def __init__(self, write_weights=False):
        super().__init__()
        self.register_buffer("q", torch.arange(1, 9, dtype=torch.int8))
        self.register_buffer("scales", torch.full((2,), 0.5))
        self.register_buffer("k_cache", torch.zeros(8))
        self.register_buffer("state", torch.full((4,), -0.0))
        self.write_weights = write_weights

    def forward(self, x):
        self.k_cache[:2] = x
        self.state.add_(1.0)
        if self.write_weights:
            self.q[0] = 0
        return x


def test_buffers_restored_copies_only_what_it_must_and_refuses_a_written_weight():
    from llmcore.pipeline.parity import buffers_restored

    module = WeightsAndCaches()
    with buffers_restored(module):
        module(torch.ones(2))
    assert not module.k_cache.any() and torch.equal(module.state, torch.full((4,), -0.0))
    assert torch.equal(module.state.signbit(), torch.ones(4, dtype=torch.bool))  # -0.0 copied, not zeroed
    assert torch.equal(module.q, torch.arange(1, 9, dtype=torch.int8))

    module = WeightsAndCaches(write_weights=True)
    with pytest.raises(LlmcoreError, match="integer buffer 'q'") as raised:
        with buffers_restored(module):
            module(torch.ones(2))
    assert raised.value.stage == "parity"
    module = WeightsAndCaches(write_weights=True)
    with buffers_restored(module, written=[module.q]):  # a buffer the program writes is saved
        module(torch.ones(2))
    assert torch.equal(module.q, torch.arange(1, 9, dtype=torch.int8))
