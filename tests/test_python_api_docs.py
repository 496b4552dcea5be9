"""Every ```python block of docs/python-api.md runs, in order, in one namespace and one empty
folder, as a reader would paste them one after another: the page cannot drift from the API."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)


def test_the_page_has_an_example_of_each_form():
    blocks = python_blocks(PAGE.read_text())
    code = "\n".join(blocks)
    for call in ("llmcore.export(", "llmcore.export_steps(", "partitioners=[", ".quantize(quantizer)",
                 "llmcore.load(", ".generate(", ".chat("):
        assert call in code, call


def test_every_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for number, block in enumerate(python_blocks(PAGE.read_text()), 1):
        try:
            exec(compile(block, f"{PAGE.name}, example {number}", "exec"), namespace)
        except Exception as exc:
            first = block.strip().splitlines()[0]
            pytest.fail(f"example {number} of {PAGE.name} (starting {first!r}) failed: {type(exc).__name__}: {exc}")
    out = capsys.readouterr().out
    assert "delegated nodes:" in out and "prompt tokens came from the cache" in out
