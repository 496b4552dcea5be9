"""The core on executorch 1.4.x, as a user runs it (`make test-mps`, in .venv-et14):
`llmcore export` of the tiny nanoGPT to XNNPACK (parity checked) and to MPS with XNNPACK
behind it (parity skipped: the pip runtime has no MPS), each a subprocess with this
env's python. The main suite covers the same CLI on executorch 1.5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

# ExecuTorch 1.5 removed MPS: there llmcore-mps refuses to import (and the main env does
# not install it), so this module skips; `make test-mps` runs it on executorch 1.4.1.
pytest.importorskip("llmcore_mps", exc_type=ImportError)


def llmcore(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("LLMCORE_LOAD_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "llmcore", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def export(plugins: str, out) -> dict:
    result = llmcore("export", "--model", "nanogpt", "--config", "tiny", "--plugins", plugins, "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.is_file() and out.stat().st_size > 0
    assert (out.parent / "tokenizer.json").is_file()
    return json.loads(out.with_name(out.stem + ".report.json").read_text())


def test_this_env_is_executorch_1_4_with_mps():
    assert metadata.version("executorch").startswith("1.4."), metadata.version("executorch")
    result = llmcore("plugins", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["failed"] == [], data["failed"]
    assert {"mps", "nanogpt", "xnnpack"} <= {p["name"] for p in data["plugins"]}


def test_export_xnnpack(tmp_path):
    report = export("xnnpack", tmp_path / "xnn.pte")
    assert set(report["delegation"]["by_backend"]) == {"XnnpackBackend"}
    assert report["parity"]["top1_agreement"] == 1.0 and report["parity"]["max_abs_diff"] < 1e-3


def test_export_mps_then_xnnpack(tmp_path):
    report = export("mps,xnnpack", tmp_path / "mps.pte")
    assert [b["name"] for b in report["backends"]] == ["mps", "xnnpack"]
    assert report["transforms"] == ["mps-static-length"]
    assert report["delegation"]["by_backend"]["MPSBackend"]["delegates"] >= 1
    assert "MPSBackend" in report["parity"]["missing_backends"] and "Apple GPUs" in report["parity"]["skipped"]
