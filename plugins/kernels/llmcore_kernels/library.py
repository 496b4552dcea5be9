"""Finding and loading the native libraries of llmcore-kernels.

The project's CMake (``make runner``) builds them into the build folder: the first two from
this plugin's C++ sources (``plugins/kernels/csrc``), the others from the runtime's
(``runtime/kernels``: code ``llmcore_runner`` links, which this package loads into Python
processes too):

* ``libllmcore_kernels.so``: the ExecuTorch kernels, registered with the runtime on load;
* ``libllmcore_kernels_aot.so``: their PyTorch registration; it links the first, so loading
  it in Python registers the ops with both PyTorch and the ExecuTorch runtime;
* ``libllmcore_xnnpack_reshape.so``: XNNPACK's whole-runtime reshape only when a delegate's
  input shapes change, as ``llmcore_runner`` does (``runtime/kernels/xnnpack_reshape.cpp``);
  loaded before ExecuTorch's bindings;
* ``libllmcore_threads.so``: the threads the first and the core runtime's attention library
  (``libllmcore_llm_ops.so``, :func:`llmcore.runtime.libraries.llm_ops_library`) split their
  work over in a program with no delegate, one pool for the process
  (``runtime/kernels/kernel_threads.h``, :func:`use_own_threads`); both link it, and it is
  found next to them.

They are looked up in ``$LLMCORE_KERNELS_LIB_DIR`` when it is set, else in ``build/`` of the
checkout this package is installed from (editable installs).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from llmcore.errors import LlmcoreError
from llmcore.runtime import libraries

PLUGIN = "kernels"
LIB_DIR_ENV = "LLMCORE_KERNELS_LIB_DIR"
RUNTIME_LIBRARY = "libllmcore_kernels.so"
AOT_LIBRARY = "libllmcore_kernels_aot.so"
XNNPACK_RESHAPE_LIBRARY = "libllmcore_xnnpack_reshape.so"
THREADS_LIBRARY = "libllmcore_threads.so"
_SOURCE_ROOT = Path(__file__).resolve().parents[3]  # the checkout, for an editable install

_loaded = False


def library_dir() -> Path:
    value = os.environ.get(LIB_DIR_ENV)
    return Path(value) if value else _SOURCE_ROOT / "build"


def library_path(file_name: str = RUNTIME_LIBRARY) -> Path:
    """The built library, or a `LlmcoreError` that says how to build it (its stage is
    filled in by the caller: ``transform`` during an export, ``run`` when loading a program)."""
    path = library_dir() / file_name
    if not path.is_file():
        where = f"${LIB_DIR_ENV}" if os.environ.get(LIB_DIR_ENV) else "the build folder of the checkout"
        raise LlmcoreError(
            f"the llmcore-kernels native library {file_name} is not built (looked in {where}: {path.parent}).",
            plugin=PLUGIN,
            fix=f"run `make runner` in {_SOURCE_ROOT} (it builds the kernels with the C++ runner), "
            f"or set {LIB_DIR_ENV} to the folder that holds {file_name}.",
        )
    return path


def runtime_library() -> Path:
    """The ExecuTorch-only library (what runners without PyTorch load)."""
    return library_path(RUNTIME_LIBRARY)


def xnnpack_reshape_library() -> Path:
    """XNNPACK's whole-runtime reshape only when a delegate's input shapes change, for a
    Python process to load before ExecuTorch's bindings (``runtime/kernels/xnnpack_reshape.cpp``)."""
    return library_path(XNNPACK_RESHAPE_LIBRARY)


def _loaded_threads_library():
    """``libllmcore_threads.so`` through ctypes when a copy is already loaded in this process
    (as a dependency of the kernels: ``RTLD_NOLOAD`` loads nothing new), else None."""
    try:
        return ctypes.CDLL(str(library_path(THREADS_LIBRARY)), mode=os.RTLD_NOW | os.RTLD_NOLOAD)
    except (LlmcoreError, OSError):
        return None


def use_own_threads(own: bool) -> bool:
    """Run the kernels of this process on their own threads, or on ExecuTorch's pool
    (``runtime/kernels/kernel_threads.h``, ``kernel_threads_use_own``). Returns False, and changes
    nothing, when no library of this package is loaded in this process."""
    threads = _loaded_threads_library()
    if threads is None:
        return False
    threads.llmcore_kernel_threads_use_own(ctypes.c_int(1 if own else 0))
    return True


def own_threads() -> bool:
    """Whether the kernels of this process run on their own threads (False when no library
    of this package is loaded)."""
    threads = _loaded_threads_library()
    return threads is not None and bool(threads.llmcore_kernel_threads_own())


def load() -> None:
    """Register the kernels with PyTorch and with this process's ExecuTorch runtime."""
    global _loaded
    if _loaded:
        return
    import torch

    # The kernels register into the runtime that the Python bindings use: import them first
    # so that the library's dependency on libexecutorch.so resolves to the copy they loaded.
    libraries.runtime_bindings()

    path = library_path(AOT_LIBRARY)
    try:
        torch.ops.load_library(str(path))
    except OSError as exc:
        raise LlmcoreError(
            f"could not load {path}: {exc}.",
            plugin=PLUGIN,
            fix="rebuild it against this environment's torch and executorch: run `make runner`.",
        ) from exc
    _loaded = True
