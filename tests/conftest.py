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
    """Exports of the tiny nanoGPT, made lazily once per run: name -> ExportResult. Under
    pytest-xdist the workers share them: the first to ask exports (holding a lock), the
    others read the report it wrote."""
    from llmcore.pipeline import ExportResult, export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions
    from llmcore.testing.locks import one_at_a_time, shared_folder

    folder = shared_folder(tmp_path_factory) / "exports"
    folder.mkdir(exist_ok=True)
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
            if variants[name].get("model", "nanogpt") not in registry.names("model_families"):
                pytest.skip(f"the {variants[name]['model']} family is not installed")
            sub = folder / name
            pte = sub / f"{name}.pte"
            with one_at_a_time(folder / f"{name}.lock"):
                report_path = pte.with_name(f"{name}.report.json")
                if report_path.is_file():  # another worker exported it (the report is written last)
                    report = read_json(report_path)
                    cache[name] = ExportResult(pte, report_path, Path(report["outputs"]["tokenizer"]), report)
                else:
                    sub.mkdir(exist_ok=True)
                    options = ExportOptions(
                        **{"model": "nanogpt", "config": "tiny", **variants[name]}, output=str(pte), quiet=True
                    )
                    cache[name] = export(options, registry)
        return cache[name]

    return get
