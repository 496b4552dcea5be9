"""Shared fixtures: tiny exports made once per session, and a CLI runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
LLMCORE = [sys.executable, "-m", "llmcore"]


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: int = 600):
    """Run ``llmcore ARGS`` as a user would, in a subprocess; returns CompletedProcess."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [*LLMCORE, *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout
    )


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
    }
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            sub = folder / name
            sub.mkdir()
            options = ExportOptions(
                model="nanogpt", config="tiny", output=str(sub / f"{name}.pte"), quiet=True, **variants[name]
            )
            cache[name] = export(options, registry)
        return cache[name]

    return get


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
