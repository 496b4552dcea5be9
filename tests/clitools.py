"""Running the CLI the way a user does, for tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLMCORE = [sys.executable, "-m", "llmcore"]


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: int = 600):
    """Run ``llmcore ARGS`` as a user would, in a subprocess; returns CompletedProcess."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [*LLMCORE, *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout
    )


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
