"""ISA views: run ExecuTorch and llama.cpp on this machine as on a CPU with fewer features.

Which kernels run is decided at run time from the CPU's features: XNNPACK's by cpuinfo,
llmcore's own by cpu_isa.h. A wrong answer on one instruction set and not another is the
kind of bug no single machine finds (issue 58), so the tests run the C++ runner and the
Python runtime in every view the machine can present (tests/runtime/test_recipes_agree.py),
and the benchmarks measure the AVX2 code paths on an AVX-512 machine. The views hide the
newer features from the code that picks kernels:

- ExecuTorch: ``isa_view.c``, preloaded (``LD_PRELOAD``), clears them from cpuinfo's
  feature table before XNNPACK reads it; the report it writes proves it took effect. In a
  Python process ATen, MKL and oneDNN are narrowed too, by their own variables, and
  llmcore's kernels (the int GEMMs, the runner's attention) by ``LLMCORE_KERNELS_MAX_ISA``.
- llama.cpp: its CPU backend (``libggml-cpu.so``) built for the view's instruction sets
  (``llamacpp_peer.build_cpu_backend``), used by the same tools through ``LD_LIBRARY_PATH``.

A view hides instructions, not the machine: caches, memory bandwidth and the cores' speed
at AVX2 code stay this machine's, so its figures compare llmcore with llama.cpp in one
run, not with figures taken on a real AVX2-only CPU.

The views:

- ``native``: the machine as it is.
- ``avx512``: AVX-512 with VNNI and BF16 but no AMX, no AVX-512 FP16 and no VEX-coded VNNI
  (the AVX-512 EPYC, Zen 4; Ice Lake and Cooper Lake Xeons): on a Xeon with AMX, the
  int8 GEMMs XNNPACK runs without its AMX tiles.
- ``avxvnni``: AVX2 with the VEX-coded VNNI and no AVX-512 (Intel's laptop and desktop
  cores since Alder Lake): XNNPACK's AVX-VNNI kernels, llmcore's int GEMMs on the
  VEX-coded vpdpbusd (cpu_isa.h's ``avx_vnni``) and its AVX2 code for the rest.
- ``avx2``: an x86-64-v3 CPU without AVX-512 or VNNI (the AVX2-only EPYC): XNNPACK's AVX2
  kernels, llmcore's AVX2 GEMMs and attention.
- ``sse4``: an x86-64 without AVX (x86-64-v2): XNNPACK's SSE kernels, llmcore's portable
  loops and baseline attention. What any x86-64 machine without AVX2 runs.

    .venv/bin/python -m llmcore.testing.isa_view avx2    # build the shim, show what it hides
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout, for main()'s runner
SOURCE = Path(__file__).with_suffix(".c")
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmcore" / "isa-view"

# view -> cpuinfo features to hide (fnmatch patterns; None: the machine as it is)
VIEWS: dict[str, tuple[str, ...] | None] = {
    "native": None,
    # AVX-512 F/BW/VL/VNNI/BF16 as Zen 4 has them: AMX, AVX-512 FP16, AVX10 and the VEX-coded
    # VNNI family hidden.
    "avx512": ("amx*", "avx512fp16", "avx512vp2intersect", "avx10*", "avxvnni", "avx_vnni*", "avx_ne_convert"),
    # AVX2 + FMA + F16C + AVX-VNNI: the AVX-512 family, AVX10, AMX and VNNI's later VEX
    # extensions hidden.
    "avxvnni": ("avx512*", "avx10*", "amx*", "avx_vnni_int*", "avx_ne_convert"),
    # AVX2 + FMA + F16C: every AVX-512 and AVX10 extension, AMX, and the VEX-coded VNNI
    # and its successors (which XNNPACK also uses for its int8 dot products).
    "avx2": ("avx512*", "avx10*", "amx*", "avxvnni", "avx_vnni*", "avx_ne_convert"),
    # SSE4.2 and POPCNT: every AVX extension, FMA (3 and 4), F16C, XOP and AMX.
    "sse4": ("avx*", "fma*", "f16c", "xop", "amx*"),
}
# The same narrowing for the libraries torch brings into a Python process (ExecuTorch's
# custom ops reach ATen's vectorized code and MKL's BLAS), and for llmcore-kernels' int4
# GEMM (which asks the CPU itself, not cpuinfo): their own switches.
LIBRARY_ENV = {"avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
                          "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
               "avxvnni": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                           "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI", "LLMCORE_KERNELS_MAX_ISA": "avx_vnni"},
               "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                        "LLMCORE_KERNELS_MAX_ISA": "avx2"},
               "sse4": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                        "ONEDNN_MAX_CPU_ISA": "SSE41", "LLMCORE_KERNELS_MAX_ISA": "portable"}}
# cpuinfo's names -> the kernel's (/proc/cpuinfo), to check the table against what Linux
# reports: a layout the shim misreads would show features the CPU lacks, or miss some. (Not
# AMX: a virtual machine may list it and not grant its tile state, which cpuinfo checks.)
PROC_NAMES = {
    "avx": "avx", "avx2": "avx2", "fma3": "fma", "f16c": "f16c", "avx512f": "avx512f",
    "avx512bw": "avx512bw", "avx512vl": "avx512vl", "avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni",
    "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "bmi2": "bmi2", "adx": "adx", "movbe": "movbe",
    "sha": "sha_ni",
}


class ViewNotApplied(RuntimeError):
    """The process ran without the view (or with a table the shim misread)."""


def check_view(view: str) -> None:
    if view not in VIEWS:
        raise SystemExit(f"isa_view: unknown view {view!r}; known: {', '.join(VIEWS)}")


# view -> the features a CPU needs to present it (/proc/cpuinfo's names)
NEEDS: dict[str, tuple[str, ...]] = {
    "native": (), "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    "avxvnni": ("avx2", "fma", "f16c", "avx_vnni"), "avx2": ("avx2", "fma", "f16c"), "sse4": ("sse4_2", "popcnt")}


def presentable_views() -> list[str]:
    """The views this machine can present, native first: those whose kept features it has
    and that hide something it has (on an AVX2-only CPU the avx2 view is the native one)."""
    flags = proc_flags()
    views = ["native"]
    for view, patterns in VIEWS.items():
        if patterns is None or not all(f in flags for f in NEEDS[view]):
            continue
        if any(fnmatch.fnmatch(f, p) for f in flags for p in patterns):
            views.append(view)
    return views


def shim(cache: Path = DEFAULT_CACHE) -> Path:
    """The preload library, compiled here with the system's C compiler (once per source
    change; written under another name and renamed, so that processes building it at once
    never load a half-written file)."""
    out = cache / "isa_view.so"
    if out.is_file() and out.stat().st_mtime >= SOURCE.stat().st_mtime:
        return out
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if not compiler:
        raise SystemExit("isa_view: no C compiler (cc) to build the preload library; install gcc or clang")
    cache.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"isa_view.{os.getpid()}.so")
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(SOURCE), "-ldl", "-lpthread"],
                   check=True)
    os.replace(partial, out)
    return out


def executorch_env(view: str, report: Path, cache: Path = DEFAULT_CACHE) -> dict[str, str]:
    """Environment additions that make an ExecuTorch process (the Python runtime or
    ``llmcore_runner``) pick its kernels as on ``view``; empty for the native view."""
    check_view(view)
    if VIEWS[view] is None:
        return {}
    return {"LD_PRELOAD": str(shim(cache)), "ISA_VIEW_HIDE": ",".join(VIEWS[view]), "ISA_VIEW_REPORT": str(report),
            **LIBRARY_ENV.get(view, {})}


def proc_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def read_report(report: Path, view: str) -> tuple[list[str], list[str]]:
    """(features cpuinfo saw, features hidden) from a process run under ``view``; raises
    :class:`ViewNotApplied` when the process never went through the shim or the table it
    read disagrees with Linux's flags."""
    if not report.is_file():
        raise ViewNotApplied(f"view {view}: the process never initialized cpuinfo through the shim "
                             f"(no report at {report}): its kernels were picked for the whole CPU")
    lines = dict(line.split(":", 1) for line in report.read_text().splitlines() if ":" in line)
    seen, hidden = lines.get("seen", "").split(), lines.get("hidden", "").split()
    flags = proc_flags()
    wrong = [name for name, proc in PROC_NAMES.items() if (name in seen) != (proc in flags)]
    if wrong:
        raise ViewNotApplied(f"view {view}: cpuinfo's table as read disagrees with /proc/cpuinfo on "
                             f"{', '.join(wrong)}: its layout is not the one isa_view.c knows")
    return seen, hidden


def run_in_view(view: str, command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command)`` under ``view``, checked to have taken effect. The result
    carries ``features``: (features cpuinfo saw, features hidden), None in the native view."""
    if VIEWS.get(view) is None:
        check_view(view)
        done = subprocess.run(command, **kwargs)
        done.features = None
        return done
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report"
        env = dict(kwargs.pop("env", None) or os.environ) | executorch_env(view, report)
        done = subprocess.run(command, env=env, **kwargs)
        done.features = read_report(report, view) if done.returncode == 0 else None
        return done


def main() -> None:
    view = sys.argv[1] if len(sys.argv) > 1 else "avx2"
    # the runner's --help initializes the thread pool, which initializes cpuinfo
    done = run_in_view(view, [str(ROOT / "build" / "llmcore_runner"), "--help"], capture_output=True, check=True)
    if done.features is None:
        print(f"view {view} hides nothing")
        return
    seen, hidden = done.features
    print(f"cpuinfo sees: {' '.join(seen)}")
    print(f"view {view} hides: {' '.join(hidden) or 'nothing'}")


if __name__ == "__main__":
    main()
