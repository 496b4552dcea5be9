"""llmcore-mps on ExecuTorch 1.5+, which removed the MPS backend: the plugin refuses to
import with one line saying why and what to use instead; `llmcore plugins` lists it as
failed with that line, other plugins still load (an export without MPS is
unaffected: test_discovery.py), and `--plugins mps` fails in one line
naming the plugin and the fix. (The plugin's own tests run on 1.4.1: `make test-mps`.)

The plugin is not installed in this env (its pyproject.toml caps executorch below 1.5),
so it is made visible the way an installed copy would be: a dist-info with its entry
point and the package, in a throwaway site folder on PYTHONPATH. Not plugins/mps itself:
an editable install elsewhere leaves a llmcore_mps.egg-info there, a second entry point.
"""

from __future__ import annotations

import json
import os
import re
from importlib import metadata

import pytest

from clitools import ROOT

EXECUTORCH = tuple(int(p) for p in re.findall(r"\d+", metadata.version("executorch"))[:2])
pytestmark = pytest.mark.skipif(EXECUTORCH < (1, 5), reason="executorch < 1.5 has MPS; make test-mps tests the plugin")

WHY = "ExecuTorch 1.5 removed its MPS backend"


@pytest.fixture
def mps_env(tmp_path):
    site = tmp_path / "site"
    info = site / "llmcore_mps-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llmcore-mps\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[llmcore]\nmps = llmcore_mps\n")
    (site / "llmcore_mps").symlink_to(ROOT / "plugins" / "mps" / "llmcore_mps", target_is_directory=True)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def _says_why_and_what_instead(text: str) -> None:
    assert "\n" not in text.strip()
    assert WHY in text and metadata.version("executorch") in text
    assert "coreml" in text and "executorch 1.4.x" in text and "make test-mps" in text


def test_plugins_lists_the_refusal_in_one_line(mps_env, cli):
    result = cli("plugins", "--json", env=mps_env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    failed = {f["name"]: f["error"] for f in data["failed"]}
    assert set(failed) == {"mps"}
    assert failed["mps"].startswith("failed to import: ImportError: llmcore-mps needs executorch 1.4.x")
    _says_why_and_what_instead(failed["mps"])
    assert {"coreml", "nanogpt", "xnnpack"} <= {p["name"] for p in data["plugins"]}

    text = cli("plugins", env=mps_env)
    assert text.returncode == 0, text.stderr
    lines = [line for line in text.stdout.splitlines() if "mps" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("FAILED mps  (llmcore_mps): failed to import: ImportError:")
    _says_why_and_what_instead(lines[0])


def test_export_with_mps_fails_in_one_line_naming_the_plugin_and_fix(mps_env, cli, tmp_path):
    out = tmp_path / "mps.pte"
    args = ["export", "--model", "nanogpt", "--config", "tiny", "--plugins", "mps,xnnpack", "--quiet", "-o", str(out)]
    result = cli(*args, env=mps_env)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert line.startswith("llmcore: error: [") and "/mps] backend 'mps' is unavailable" in line
    _says_why_and_what_instead(line)
    assert "Traceback" not in result.stderr and not out.exists()

