"""llama.cpp as the peer for the SmolLM2 rows of the benchmarks: ``llama-bench`` (speed),
``llama-quantize`` (Q4_0 / Q8_0 from the same GGUF) and ``llama-perplexity``.

It is built once from the PyPI ``llama-cpp-python`` sdist (its ``vendor/llama.cpp``) into a
cache folder, because PyPI is the only network this project may reach. On 2 cores the
build takes 15-25 minutes; later runs reuse the binary.

    .venv/bin/python benchmarks/llamacpp_peer.py build            # just build it
    .venv/bin/python benchmarks/llamacpp_peer.py run MODEL.gguf   # build if needed, then bench
    .venv/bin/python benchmarks/llamacpp_peer.py run MODEL.gguf --isa-view avx2

The tools are built for this machine (``GGML_NATIVE``). For an ISA view (``llmcore/testing/isa_view.py``)
only the CPU backend, ``libggml-cpu.so``, is built again, for the view's instruction sets
(under a minute), and the same tools load it through ``LD_LIBRARY_PATH``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = ROOT / ".cache" / "llama.cpp"
SDIST = "llama-cpp-python==0.3.36"


TOOLS = ("llama-bench", "llama-quantize", "llama-perplexity")
# ISA view -> the CPU backend's instruction sets (ggml's own options); see llmcore/testing/isa_view.py
_X86_64_V3 = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
              "-DGGML_BMI2=ON"]
VIEW_CPU_FLAGS = {
    "avx512": [*_X86_64_V3, "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON",
               "-DGGML_AVX512_BF16=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
               "-DGGML_AMX_BF16=OFF"],
    "avxvnni": [*_X86_64_V3, "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=ON"],
    "avx2": [*_X86_64_V3, "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"],
}

# ISA view -> what its libggml-cpu.so must say it was compiled with (ggml_cpu_has_*)
VIEW_COMPILED = {
    "avx512": {"avx2": 1, "avx512": 1, "avx512_vnni": 1, "avx_vnni": 0},
    "avxvnni": {"avx2": 1, "avx512": 0, "avx512_vnni": 0, "avx_vnni": 1},
    "avx2": {"avx2": 1, "avx512": 0, "avx512_vnni": 0, "avx_vnni": 0},
}


def tool_path(name: str, cache: Path = DEFAULT_CACHE) -> Path:
    return cache / "build" / "bin" / name


def llama_bench_path(cache: Path = DEFAULT_CACHE) -> Path:
    return tool_path("llama-bench", cache)


def build_llama_bench(cache: Path = DEFAULT_CACHE, jobs: int | None = None) -> Path:
    """Download the sdist (if absent), configure vendor/llama.cpp and build its tools (one build)."""
    binary = llama_bench_path(cache)
    if all(tool_path(t, cache).is_file() for t in TOOLS):
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        # Only this package as source: ":all:" would also build pip's build dependencies
        # (cmake among them) from source to read the sdist's metadata, which takes longer than
        # the llama.cpp build itself.
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                        SDIST, "-d", str(cache)], check=True)
        sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    source = cache / "src"
    if not (source / "CMakeLists.txt").is_file():
        shutil.rmtree(source, ignore_errors=True)
        with tarfile.open(sdists[-1]) as tar:
            top = tar.getnames()[0].split("/")[0]
            prefix = f"{top}/vendor/llama.cpp/"
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(source, members=[m for m in members if m.name], filter="data")
    build = cache / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                    # The CPU may report AMX while the (virtual) machine does not grant the
                    # tile state: llama.cpp's AMX kernels then die (SIGILL / SIGSEGV). With
                    # GGML_NATIVE the GGML_AMX_* options are ignored, so turn the ISA off.
                    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", *TOOLS, "-j", str(jobs or os.cpu_count() or 1)],
                   check=True)
    for tool in TOOLS:
        if not tool_path(tool, cache).is_file():
            raise FileNotFoundError(f"{tool} was built but is not at {tool_path(tool, cache)}")
    return binary


@functools.lru_cache(maxsize=None)  # built and checked once per process, not once per run
def build_cpu_backend(view: str, cache: Path = DEFAULT_CACHE, jobs: int | None = None) -> Path:
    """The folder holding ``libggml-cpu.so`` built for ISA view ``view`` (the tools' own
    build must exist: it is configured from the same source). Checked: the library says
    it was compiled with the view's instruction sets (VIEW_COMPILED) and no others."""
    if view not in VIEW_CPU_FLAGS:
        raise SystemExit(f"llamacpp_peer: no CPU backend flags for view {view!r}; known: {', '.join(VIEW_CPU_FLAGS)}")
    build_llama_bench(cache, jobs)
    build = cache / f"build-{view}"
    library = build / "bin" / "libggml-cpu.so"
    if not library.is_file():
        subprocess.run(["cmake", "-S", str(cache / "src"), "-B", str(build), "-G", "Ninja",
                        "-DCMAKE_BUILD_TYPE=Release", *VIEW_CPU_FLAGS[view], "-DLLAMA_CURL=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"],
                       check=True, capture_output=True)
        subprocess.run(["cmake", "--build", str(build), "--target", "ggml-cpu", "-j", str(jobs or os.cpu_count() or 1)],
                       check=True, capture_output=True)
    import ctypes

    cpu = ctypes.CDLL(str(library))
    compiled = {name: getattr(cpu, f"ggml_cpu_has_{name}")() for name in ("avx2", "avx512", "avx512_vnni", "avx_vnni")}
    if compiled != VIEW_COMPILED[view]:
        raise SystemExit(f"llamacpp_peer: {library} was not built for view {view}: {compiled}")
    return library.parent


def view_env(view: str, cache: Path = DEFAULT_CACHE) -> dict[str, str]:
    """Environment under which the tools run on ``view``'s CPU backend ({} for native)."""
    if view == "native":
        return {}
    return {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(build_cpu_backend(view, cache)),
                                                             os.environ.get("LD_LIBRARY_PATH")]))}


def requantized_path(source: Path, kind: str, out_dir: Path) -> Path:
    """Where :func:`requantize` writes ``source`` as ``kind``: its name with the type it names, if
    any, replaced ("llama-3.2-1b.Q4_0.gguf" -> "llama-3.2-1b.Q4_K_M.gguf"). Not its name up to the
    first dot: Llama-3.2-1B's and 3B's would both be "llama-3"."""
    stem = re.sub(r"\.[A-Z0-9_]+$", "", source.name.removesuffix(".gguf"))
    return out_dir / f"{stem}.{kind}.gguf"


def requantize(source: Path, kind: str, out_dir: Path, cache: Path = DEFAULT_CACHE) -> Path:
    """``source`` re-quantized by ``llama-quantize`` to ``kind`` (Q4_0, Q8_0, ...), made once:
    written under a temporary name and renamed when whole, so that a failed or killed run
    leaves no file a later one would take as made."""
    out = requantized_path(source, kind, out_dir)
    if not out.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        done = subprocess.run([str(tool_path("llama-quantize", cache)), "--allow-requantize", str(source), str(partial),
                               kind], capture_output=True, text=True)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise SystemExit(f"llamacpp_peer: llama-quantize could not make {kind} from {source.name} "
                             f"(exit {done.returncode}): {(done.stderr or done.stdout).strip()[-300:]}")
        partial.replace(out)
    return out


def run_llama_bench(gguf: Path, prompt_tokens: int, new_tokens: int, threads: int,
                    cache: Path = DEFAULT_CACHE, repetitions: int = 3, view: str = "native") -> dict:
    """Prefill and decode tok/s of llama.cpp on `gguf` (its own test shapes: pp and tg)."""
    binary = llama_bench_path(cache)
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", str(prompt_tokens), "-n", str(new_tokens),
                          "-t", str(threads), "-r", str(repetitions), "-o", "json"],
                         check=True, capture_output=True, text=True, env=dict(os.environ) | view_env(view, cache))
    rows = json.loads(out.stdout)
    result = {"build": rows[0].get("build_commit"), "type": rows[0].get("model_type"),
              "size_mib": rows[0].get("model_size", 0) / 2**20}
    for row in rows:
        key = "prefill_tok_s" if row.get("n_prompt") else "decode_tok_s"
        result[key] = row["avg_ts"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build", "run"])
    parser.add_argument("gguf", nargs="?")
    parser.add_argument("--cache", default=str(DEFAULT_CACHE))
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--isa-view", default="native", help="native, or a view of llmcore/testing/isa_view.py (avx2)")
    args = parser.parse_args()
    cache = Path(args.cache)
    print(build_llama_bench(cache))
    if args.command == "run":
        if not args.gguf:
            parser.error("run needs a GGUF file")
        print(json.dumps(run_llama_bench(Path(args.gguf), args.prompt_tokens, args.new_tokens, args.threads, cache,
                                         view=args.isa_view)))


if __name__ == "__main__":
    main()
