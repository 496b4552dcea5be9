"""Fixtures: the native libraries (built with CMake when missing), one small export that
uses the fused kernel and one with a KV cache, each made once per session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmcore.testing.locks import one_at_a_time

ROOT = Path(__file__).resolve().parents[3]
BUILD = ROOT / "build"
RUNNER = BUILD / "llmcore_runner"


@pytest.fixture(scope="session")
def kernel_library() -> Path:
    """The folder holding libllmcore_kernels.so, libllmcore_kernels_aot.so,
    libllmcore_llm_ops.so and libllmcore_xnnpack_reshape.so (and, for the default folder,
    llmcore_runner), building them into build/ when missing."""
    from llmcore.runtime import libraries
    from llmcore_kernels import library

    targets = [BUILD / library.RUNTIME_LIBRARY, BUILD / library.AOT_LIBRARY, BUILD / libraries.LLM_OPS_LIBRARY,
               BUILD / library.XNNPACK_RESHAPE_LIBRARY, RUNNER]
    if os.environ.get(library.LIB_DIR_ENV):
        folder = library.library_dir()
        if not (folder / library.AOT_LIBRARY).is_file():
            pytest.fail(f"{library.LIB_DIR_ENV}={folder} holds no {library.AOT_LIBRARY}")
        return folder
    with one_at_a_time(BUILD / ".tests-build.lock"):  # pytest-xdist: one worker builds, the others wait
        _build(targets)
    return BUILD


def _build(targets) -> None:
    if not all(t.is_file() for t in targets):
        # The venv's cmake when present (the build needs CMake >= 3.28), else PATH's.
        venv_cmake = Path(sys.executable).parent / "cmake"
        cmake = str(venv_cmake) if venv_cmake.is_file() else shutil.which("cmake")
        if cmake is None:
            pytest.skip("cmake is not available to build the kernel library")
        subprocess.run(
            [cmake, "-S", str(ROOT), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release",
             f"-DPython3_EXECUTABLE={sys.executable}"],
            check=True, stdout=subprocess.DEVNULL,
        )
        subprocess.run(
            [cmake, "--build", str(BUILD), "-j2", "--target", "llmcore_kernels", "llmcore_kernels_aot",
             "llmcore_llm_ops_keyed", "llmcore_xnnpack_reshape", "llmcore_runner"],
            check=True, stdout=subprocess.DEVNULL,
        )


@pytest.fixture(scope="session")
def fused_export(kernel_library, tmp_path_factory):
    """The tiny random Llama exported for XNNPACK with --transforms fused-rmsnorm."""
    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    out = tmp_path_factory.mktemp("fused") / "tiny.pte"
    options = ExportOptions(
        model="llama", config="tiny", plugins=["xnnpack"], transforms=["fused-rmsnorm"], output=str(out), quiet=True
    )
    return export(options, load_registry())


@pytest.fixture(scope="session")
def runner(kernel_library) -> Path:
    path = kernel_library / "llmcore_runner"
    if not path.is_file():
        pytest.skip(f"no llmcore_runner in {kernel_library}")
    return path


@pytest.fixture(scope="session")
def llmcore_cli():
    """``llmcore ARGS`` in a fresh process, as a user runs it."""

    def run(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "llmcore", *args],
            capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
        )

    return run


@pytest.fixture(scope="session")
def kv_export(kernel_library, tmp_path_factory):
    """The tiny random Llama with its KV cache (llama::update_cache, llama::custom_sdpa), for XNNPACK."""
    from llmcore.pipeline import export
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    out = tmp_path_factory.mktemp("kv") / "tiny.pte"
    return export(ExportOptions(model="llama", config="tiny", plugins=["xnnpack"], output=str(out), quiet=True),
                  load_registry())


@pytest.fixture
def passes_in_isa_view():
    """:func:`tests_pass_in_isa_view`, for a test to call."""
    return tests_pass_in_isa_view


def tests_pass_in_isa_view(view: str, test_file: str, keyword: str) -> None:
    """The tests of ``test_file`` selected by ``keyword`` pass again in a process whose kernels
    see only ``view``'s instruction sets (llmcore/testing/isa_view.py), so that an AVX-512
    machine checks the AVX2 and portable paths too; skips where this CPU cannot present it."""
    from llmcore.testing import isa_view

    if view not in isa_view.presentable_views():
        pytest.skip(f"this CPU cannot present the {view} view")
    done = isa_view.run_in_view(view, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file,
                                       "-k", keyword], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-2000:]
