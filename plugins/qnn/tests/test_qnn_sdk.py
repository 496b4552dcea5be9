"""Without the Qualcomm SDK of the right version, lowering to QNN stops with one clear
error, and nothing in llmcore-qnn ever imports the module that downloads an SDK.

``LLMCORE_QNN_TEST_SDK`` may name a folder laid out like an SDK (``lib/x86_64-linux-clang/
libQnnHtp.so``) of another QAIRT version, e.g. the libraries of the onnxruntime-qnn wheel
(see the README): the version check is then tested on real QNN libraries too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmcore.errors import LlmcoreError
from llmcore.testing.conformance import export_tiny
from llmcore_qnn import sdk

NEEDED = sdk.QNN_SDK_VERSION


def _export_error(tmp_path, family="nanogpt", **kw) -> LlmcoreError:
    out = tmp_path / "out" / f"{family}.pte"
    out.parent.mkdir()
    with pytest.raises(LlmcoreError) as info:
        export_tiny("qnn", family, cache=False, output=out, **kw)
    assert not list(out.parent.iterdir()), "a failed export left files behind"
    return info.value


def _assert_clear(exc: LlmcoreError, found: str):
    text = exc.one_line()
    assert exc.stage == "lower" and exc.plugin == "qnn", text
    assert NEEDED in text and "QNN_SDK_ROOT" in text and found in text, text
    assert "\n" not in text and "Traceback" not in text


def test_version_matches_the_wheel():
    """The version llmcore-qnn asks for is the one the installed wheel names."""
    import importlib.util

    spec = importlib.util.find_spec("executorch")
    script = Path(spec.submodule_search_locations[0]) / "backends/qualcomm/scripts/download_qnn_sdk.py"
    assert f'"QNN_VERSION", "{NEEDED}"' in script.read_text()  # read, never imported here


@pytest.mark.parametrize("family", ["nanogpt", "llama"])
def test_export_without_sdk_stops_with_one_clear_error(tmp_path, monkeypatch, family):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    _assert_clear(_export_error(tmp_path, family), "QNN_SDK_ROOT is not set")


def test_quantized_export_without_sdk_stops_at_lowering(tmp_path, monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    _assert_clear(_export_error(tmp_path, quantize="qnn-8a8w"), "QNN_SDK_ROOT is not set")


def test_sdk_root_that_is_not_an_sdk(tmp_path, monkeypatch):
    monkeypatch.setenv("QNN_SDK_ROOT", str(tmp_path / "missing"))
    _assert_clear(_export_error(tmp_path), "is not a folder")
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("QNN_SDK_ROOT", str(tmp_path / "empty"))
    with pytest.raises(LlmcoreError) as info:
        sdk.check_sdk()
    _assert_clear(info.value, "has no lib/x86_64-linux-clang/libQnnHtp.so")


def test_sdk_of_another_version(tmp_path, monkeypatch):
    root = tmp_path / "qairt" / "2.47.0.260601" 
    (root / sdk.HOST_LIB_DIR).mkdir(parents=True)
    (root / sdk.HOST_LIB_DIR / sdk.HTP_LIBRARY).write_bytes(b"not a library")
    monkeypatch.setenv("QNN_SDK_ROOT", str(root))
    with pytest.raises(LlmcoreError) as info:
        sdk.check_sdk()
    _assert_clear(info.value, "holds version 2.47.0.260601")


@pytest.mark.skipif(not os.environ.get("LLMCORE_QNN_TEST_SDK"), reason="LLMCORE_QNN_TEST_SDK names no QNN libraries")
def test_real_libraries_of_another_version(monkeypatch):
    monkeypatch.setenv("QNN_SDK_ROOT", os.environ["LLMCORE_QNN_TEST_SDK"])
    with pytest.raises(LlmcoreError) as info:
        sdk.check_sdk()
    _assert_clear(info.value, "holds version v2.")


def test_bad_soc_fails_before_the_sdk_check(tmp_path, monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    exc = _export_error(tmp_path, backend_options={"soc_model": "SM0000"})
    assert "soc_model" in exc.one_line() and "SM8650" in exc.one_line()


_PROBE = r"""
import json, os, sys
from llmcore.plugins import load_registry
from llmcore.testing.conformance import transformed_tiny
registry = load_registry()
for kind in ("backends", "quantizers", "transforms"):
    registry.all(kind)
import subprocess
listing = subprocess.run([sys.executable, "-m", "llmcore", "plugins", "--json"], capture_output=True, text=True)
after_listing = "executorch.backends.qualcomm" in sys.modules
transformed_tiny("llama", ["qnn"])
transformed_tiny("nanogpt", ["qnn"], skip_transforms=["kv-cache"])
after_transforms = "executorch.backends.qualcomm" in sys.modules
from llmcore_qnn.sdk import import_qualcomm
import_qualcomm("executorch.backends.qualcomm.quantizer.quantizer")
print(json.dumps({
    "listing_rc": listing.returncode,
    "listed": "qnn" in listing.stdout,
    "after_listing": after_listing,
    "after_transforms": after_transforms,
    "imported": "executorch.backends.qualcomm" in sys.modules,
    "flag_restored": "EXECUTORCH_BUILDING_WHEEL" not in os.environ,
}))
"""


def test_nothing_downloads_an_sdk(tmp_path):
    """Listing plugins, applying the transforms and importing the quantizer, with no
    QNN_SDK_ROOT and a fresh HOME: the Qualcomm package is imported only by the quantizer
    import, and no SDK cache appears (the download would go to ~/.cache/executorch)."""
    env = {k: v for k, v in os.environ.items() if k not in ("QNN_SDK_ROOT", "EXECUTORCH_BUILDING_WHEEL")}
    env.update(HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / ".cache"))
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {
        "listing_rc": 0, "listed": True, "after_listing": False, "after_transforms": False,
        "imported": True, "flag_restored": True,
    }, seen
    assert "Downloading" not in proc.stdout + proc.stderr
    assert not (tmp_path / ".cache" / "executorch").exists()
