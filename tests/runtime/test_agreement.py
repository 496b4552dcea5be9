"""llmcore_runner and `llmcore run` emit the same greedy tokens for the same program."""

from __future__ import annotations

import json
import subprocess

import pytest

from test_runner import RUNNER, binaries  # noqa: F401  (the fixture builds the runner)

PROMPTS = ["Hello, world", "The quick brown fox jumps over"]


def runner_ids(pte, prompt: str, max_new: int) -> list[int]:
    out = subprocess.run(
        [str(RUNNER), str(pte), "--prompt", prompt, "--max-new-tokens", str(max_new), "--temperature", "0",
         "--print-ids"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("ids:"))
    return [int(i) for i in line.split()[1:]]


def llmcore_ids(cli, pte, prompt: str, max_new: int) -> list[int]:
    result = cli("run", str(pte), "--prompt", prompt, "--max-new-tokens", str(max_new), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["generated_ids"]


@pytest.mark.parametrize("variant", ["xnnpack", "int8", "nocache", "ring"])
def test_runner_and_llmcore_run_agree(binaries, exports, cli, variant):  # noqa: F811
    """``ring``: a program whose sliding layers keep ring buffers takes 16 tokens per call;
    both runners feed the longer prompt in chunks and decode past the window."""
    pte = exports(variant).pte
    for prompt in PROMPTS + (["Once upon a time, in a land far away, there lived a very small dragon"]
                             if variant == "ring" else []):
        assert runner_ids(pte, prompt, 24) == llmcore_ids(cli, pte, prompt, 24)
