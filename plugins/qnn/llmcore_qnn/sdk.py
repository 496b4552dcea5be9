"""Finding the Qualcomm AI Engine Direct SDK, and importing ExecuTorch's Qualcomm backend
without ever letting it download one.

Importing any module under ``executorch.backends.qualcomm`` first runs that package's
``__init__``, which, on Linux x86-64 when ``QNN_SDK_ROOT`` is unset, downloads and unpacks
an SDK (and possibly a glibc) into ``~/.cache``. llmcore never wants that: an export must
not touch the network. :func:`import_qualcomm` is therefore the only way this plugin
imports those modules. It imports the package with ExecuTorch's own switch for that
``__init__`` (``EXECUTORCH_BUILDING_WHEEL=1``, which skips the SDK set-up entirely) and
restores the environment afterwards.

The partitioner additionally needs an SDK of the version the wheel's QNN adaptor
(``PyQnnManagerAdaptor``, ``libqnn_executorch_backend.so``) was built against:
:func:`check_sdk` says, in one error, what is missing.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

from llmcore.errors import LlmcoreError

PLUGIN = "qnn"
PACKAGE = "executorch.backends.qualcomm"

# The QAIRT version the executorch 1.4.1 wheel's QNN adaptor was built against (the
# default QNN_VERSION of executorch/backends/qualcomm/scripts/download_qnn_sdk.py; the
# wheel ships no qnn_config.sh that would override it). The adaptor talks to the SDK's
# libraries through their C API, whose custom-config structs change between minor
# releases: QAIRT 2.47-2.51 libraries load but refuse the adaptor's device config.
QNN_SDK_VERSION = "2.37.0.250724"
HOST_LIB_DIR = "lib/x86_64-linux-clang"
HTP_LIBRARY = "libQnnHtp.so"

_lock = threading.Lock()


def _need(found: str) -> LlmcoreError:
    return LlmcoreError(
        f"lowering to QNN needs the Qualcomm AI Engine Direct (QAIRT) SDK {QNN_SDK_VERSION}, "
        f"the version ExecuTorch's QNN backend was built against; {found}.",
        stage="lower",
        plugin=PLUGIN,
        fix=f"install QAIRT {QNN_SDK_VERSION} (Qualcomm Software Center) and set QNN_SDK_ROOT to its root "
        f"(the folder holding {HOST_LIB_DIR}/), with $QNN_SDK_ROOT/{HOST_LIB_DIR} on LD_LIBRARY_PATH; "
        "llmcore never downloads it.",
    )


def import_qualcomm(module: str = PACKAGE):
    """Import ``module`` (under ``executorch.backends.qualcomm``) without the package's
    SDK download. Raises :class:`LlmcoreError` when the backend's Python is unusable."""
    with _lock:
        if PACKAGE not in sys.modules:
            saved = os.environ.get("EXECUTORCH_BUILDING_WHEEL")
            os.environ["EXECUTORCH_BUILDING_WHEEL"] = "1"  # skips install_qnn_sdk()
            try:
                importlib.import_module(PACKAGE)
            except ImportError as exc:
                raise LlmcoreError(
                    f"ExecuTorch's Qualcomm backend cannot be imported: {exc}",
                    stage="lower",
                    plugin=PLUGIN,
                    fix="pip install py-cpuinfo (the Qualcomm backend requires it), "
                    "or reinstall llmcore-qnn with its dependencies.",
                ) from exc
            finally:
                if saved is None:
                    os.environ.pop("EXECUTORCH_BUILDING_WHEEL", None)
                else:
                    os.environ["EXECUTORCH_BUILDING_WHEEL"] = saved
    return importlib.import_module(module)


def _version_tuple(text: str) -> Optional[tuple[int, int, int]]:
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    return tuple(int(g) for g in match.groups()) if match else None  # type: ignore[return-value]


_BUILD_ID_PROBE = (
    "import os, sys; os.environ['EXECUTORCH_BUILDING_WHEEL'] = '1'; "
    "from executorch.backends.qualcomm.python import PyQnnManagerAdaptor as a; "
    "print('BUILD_ID=' + str(a.GetQnnSdkBuildId(sys.argv[1])))"
)


def library_build_id(library: Path, timeout: float = 300) -> Optional[str]:
    """The build id a QNN HTP library reports (``v2.37.0.250724...``), asked through the
    wheel's adaptor in a child process: the adaptor aborts the process on a library it
    cannot load, and creates no device for this query."""
    try:
        with open(library, "rb") as f:
            if f.read(4) != b"\x7fELF":
                return None
    except OSError:
        return None
    env = dict(os.environ)
    env["EXECUTORCH_BUILDING_WHEEL"] = "1"  # never the SDK download of the package __init__
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _BUILD_ID_PROBE, str(library)],
            capture_output=True, text=True, timeout=timeout, env=env,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in proc.stdout.splitlines():
        if line.startswith("BUILD_ID="):
            return line[len("BUILD_ID="):].strip() or None
    return None


def sdk_version(root: Path) -> Optional[str]:
    """The SDK's version: the build id its HTP library reports, else the version the SDK
    folder names (``.../qairt/2.37.0.250724``)."""
    build_id = library_build_id(root / HOST_LIB_DIR / HTP_LIBRARY)
    if build_id and _version_tuple(build_id):
        return build_id
    for part in reversed(root.resolve().parts):
        if _version_tuple(part):
            return part
    return None


def check_sdk(environ=None) -> Path:
    """The SDK root of ``QNN_SDK_ROOT`` when it is usable for lowering; otherwise one
    :class:`LlmcoreError` naming the version needed and ``QNN_SDK_ROOT``."""
    environ = os.environ if environ is None else environ
    value = environ.get("QNN_SDK_ROOT", "")
    if not value:
        raise _need("QNN_SDK_ROOT is not set")
    root = Path(value)
    if not root.is_dir():
        raise _need(f"QNN_SDK_ROOT={value} is not a folder")
    if not (root / HOST_LIB_DIR / HTP_LIBRARY).is_file():
        raise _need(f"QNN_SDK_ROOT={value} has no {HOST_LIB_DIR}/{HTP_LIBRARY}")
    found = sdk_version(root)
    want = _version_tuple(QNN_SDK_VERSION)
    got = _version_tuple(found) if found else None
    if got is None:
        raise _need(f"the version of the SDK at QNN_SDK_ROOT={value} cannot be told")
    if got[:2] != want[:2]:  # type: ignore[index]
        raise _need(f"QNN_SDK_ROOT={value} holds version {found}")
    return root
