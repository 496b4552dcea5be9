"""Shared fixtures: tiny exports made once per session, and a CLI runner."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from clitools import read_json, run_cli  # noqa: E402,F401


@pytest.fixture(scope="session")
def cli():
    return run_cli


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    """Exports of the tiny nanoGPT, made lazily once per session: name -> ExportResult."""
    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    folder = tmp_path_factory.mktemp("exports")
    registry = load_registry()
    variants = {
        "portable": dict(plugins=[]),
        "xnnpack": dict(plugins=["xnnpack"]),
        "int8": dict(plugins=["xnnpack"], quantize="int8-dynamic"),
        "nocache": dict(plugins=["xnnpack"], skip_transforms=["kv-cache"]),
        "static-cache": dict(plugins=["xnnpack"], transforms=["kv-cache-static"]),
        "chatml": dict(plugins=["xnnpack"], chat_template="chatml"),  # a base model given a chat template
        # Gemma 3's layout (llmcore-gemma): sliding layers with ring buffers of 31 rows, so
        # a call takes at most 16 tokens and longer prompts are fed in chunks
        "ring": dict(model="gemma", config="gemma3-tiny", plugins=["xnnpack"]),
    }
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            sub = folder / name
            sub.mkdir()
            if variants[name].get("model", "nanogpt") not in registry.names("model_families"):
                pytest.skip(f"the {variants[name]['model']} family is not installed")
            options = ExportOptions(
                **{"model": "nanogpt", "config": "tiny", **variants[name]}, output=str(sub / f"{name}.pte"), quiet=True
            )
            cache[name] = export(options, registry)
        return cache[name]

    return get
