"""libllmcore_xnnpack_reshape.so in Python processes: XNNPACK's whole-runtime reshape only
when a delegate's input shapes changed (runtime/kernels/xnnpack_reshape.cpp; llmcore_runner
links the same code, tested in tests/runtime/test_runner.py).

Each run is a fresh interpreter: whether the library takes effect depends on what was loaded
before ExecuTorch's bindings. The authority is the same program with every reshape passed
on to XNNPACK (``LLMCORE_XNNPACK_RESHAPE=always``), which must give the same logits bit for
bit, and the counts say whether the library was in the path at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# A prefill chunk, a shorter one, then decode steps: three shapes, each reused.
_RUN = r"""
import ctypes, json, sys
from llmcore.runtime import libraries
if sys.argv[2] == "bindings-first":
    from executorch.extension.pybindings import portable_lib  # too early for the library
from llmcore.runtime import Program
program = Program.load(sys.argv[1])
rows = [program.logits([5, 17, 3, 9, 40, 2], 0).tolist(), program.logits([8, 4], 6).tolist()]
for pos, token in enumerate([7, 11, 13, 21, 2], start=8):
    rows.append(program.logits([token], pos).tolist())
handle = next((h for path, h in libraries._handles.items() if path.endswith("libllmcore_xnnpack_reshape.so")), None)
counts = None
if handle is not None:
    done, skipped = ctypes.c_uint64(), ctypes.c_uint64()
    handle.llmcore_xnnpack_reshape_counts(ctypes.byref(done), ctypes.byref(skipped))
    counts = [done.value, skipped.value]
print(json.dumps({"logits": rows, "counts": counts}))
"""


def _run(pte, *, mode: str = "", order: str = "program") -> dict:
    env = {**os.environ, "LLMCORE_XNNPACK_RESHAPE": mode}
    done = subprocess.run([sys.executable, "-c", _RUN, str(pte), order], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_unchanged_shapes_skip_the_reshape_with_the_same_logits(kv_export, kernel_library):
    skipping = _run(kv_export.pte)
    always = _run(kv_export.pte, mode="always")
    assert skipping["logits"] == always["logits"]  # bit for bit
    done, skipped = skipping["counts"]
    assert skipped > 0 and done > 0
    # every call of the run above reached XNNPACK's reshape in the other
    always_done, always_skipped = always["counts"]
    assert always_skipped == 0 and always_done == done + skipped
    # seven calls in three shapes: each delegate is reshaped at most three times
    delegates = (done + skipped) // 7
    assert (done + skipped) % 7 == 0 and 0 < done <= 3 * delegates


def test_no_effect_once_the_bindings_are_imported(kv_export, kernel_library):
    late = _run(kv_export.pte, order="bindings-first")
    assert late["counts"] is None  # not loaded: it could not have taken effect
    assert late["logits"] == _run(kv_export.pte, mode="always")["logits"]


def test_the_library_is_declared_as_a_preload(kernel_library):
    from llmcore.plugins import load_registry

    [lib] = [p.record for p in load_registry().all("runtime_libraries") if p.record.name == "llmcore_xnnpack_reshape"]
    assert lib.preload and not lib.declared and lib.ops == ()
    assert lib.shared_library().is_file()
