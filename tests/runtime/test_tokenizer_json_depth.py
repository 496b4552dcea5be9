"""The C++ runner's JSON reader (runtime/src/json.h) and llmcore's Python readers
(llmcore/nesting.py) refuse the same tokenizer.json files: at most 512 arrays and objects
inside one another. A deeper one is one error line from the runner's tokenizer, not a
stack overflow (a reader recursing once per level meets 100,000 levels in 200 KB).

Runs ``build/llmcore_tokenize`` as ``make runner`` built it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from llmcore import nesting

TOKENIZE = Path(__file__).resolve().parents[2] / "build" / "llmcore_tokenize"


def tokenizer_json(depth: int) -> str:
    """A one-token BPE tokenizer.json nested ``depth`` levels deep (the root and an array in it
    count as 2)."""
    inner = "[" * (depth - 1) + "]" * (depth - 1)
    return '{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "extra": ' + inner + "}"


@pytest.mark.skipif(not TOKENIZE.exists(), reason="build/llmcore_tokenize is missing: make runner")
@pytest.mark.parametrize("depth", [512, 513, 100_000])
def test_the_runner_refuses_what_python_refuses(depth, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(tokenizer_json(depth))
    done = subprocess.run([str(TOKENIZE), str(path), "--info"], capture_output=True, text=True, timeout=60)
    refused = nesting.deeper_than(path.read_text())
    assert refused == (depth > nesting.MAX_DEPTH)
    if not refused:
        assert done.returncode == 0 and done.stdout.startswith("BPE vocab=1"), done.stderr
        return
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert "nesting too deep: more than 512" in lines[0] and str(path) in lines[0]
