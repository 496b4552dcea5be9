"""How llmcore's cost grows with the model (issue 61): for each shape of benchmarks/real_shapes.py,
its Q4_0 GGUF exported with the default CPU recipe, then run by the C++ runner, the Python
runtime and llama.cpp's llama-bench on the same file, one size after another in one run.

Per size: export wall time and peak RSS (against the GGUF's size), the program's size, each
runner's load time and peak RSS, prefill of a short and a long prompt, decode, and the
decode bound memory bandwidth sets (the weights a step reads / the median of the bandwidth
measured at the start of each round).
Every runner's tokens are checked: the C++ runner's and the Python runtime's greedy ids must
be Python's choices on the same program (``llmcore.runtime.agreement.follow``, up to a near
tie), or the row is refused. Speed and memory depend on shapes, not values: random weights.

    python benchmarks/bench_scale.py --sizes llama-300m,llama-3.2-1b --cache /data/scale \\
        --json scale.json --plot scale.png
    python benchmarks/bench_scale.py --sizes smollm2-llama,smollm2-gpt2 --isa-view avx2   # AVX2's kernels
    python benchmarks/bench_scale.py --sizes llama-3.2-1b --gguf-type Q4_K_M   # the files most users download

``--gguf-type`` other than Q4_0: the Q4_0 file re-quantized by llama.cpp's own
``llama-quantize`` (``--allow-requantize``: the types' layout and sizes, not their quality,
which random weights do not have), exported and run as the Q4_0 one, llama.cpp on that file.
Issue 61 states its targets for Q4_0 files: other types get the table, not the verdicts.

An export that the machine cannot hold is killed by the system; its row says so and the
next size runs. Run nothing else on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import bench_decode  # noqa: E402
import llamacpp_peer  # noqa: E402
import real_shapes  # noqa: E402

MIB = 2**20
# The type real_shapes.py writes, and the one issue 61 states its targets for; --gguf-type's
# others are made from it by llama-quantize.
WRITTEN_TYPE = "Q4_0"


# Started by run_with_peak: runs the command as its own child and writes that child's exit
# status and peak RSS (os.wait4) to the file named first. The extra process is the point: a
# child of this bench (which holds torch and a 1 GiB bandwidth buffer) inherits its memory's
# high-water mark until exec, so its ru_maxrss would report at least this process's size.
PEAK_LAUNCHER = """
import json, os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
code = os.waitstatus_to_exitcode(status)
open(sys.argv[1], "w").write(json.dumps({"status": code, "peak_kib": usage.ru_maxrss}))
sys.exit(0)
"""


def run_with_peak(command: list[str], env: dict | None = None,
                  stdin: str | None = None) -> tuple[int, float, float, str, str]:
    """Run ``command`` (``stdin`` as its input) with its output in files: (exit status, wall
    seconds, the peak RSS in MiB of that process alone, stdout, stderr)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as given, tempfile.TemporaryFile("w+") as out, \
            tempfile.TemporaryFile("w+") as err, tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        given.write(stdin or "")
        given.seek(0)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", PEAK_LAUNCHER, result.name, *command], stdin=given, stdout=out,
                       stderr=err, env=env, check=True)
        wall = time.perf_counter() - start
        measured = json.loads(Path(result.name).read_text())
        out.seek(0)
        err.seek(0)
        return measured["status"], wall, measured["peak_kib"] / 1024, out.read(), err.read()


def prompt_text(tokens: int) -> str:
    """``tokens`` tokens in SmolLM2's tokenizer (every shape's): the bench's prompt."""
    return " ".join(["the"] * tokens)


def export(shape: str, gguf: Path, pte: Path, max_seq_len: int, plugins: str = "") -> dict:
    """``llmcore export`` of the file as a user runs it: without ``--plugins`` (the default
    backends, kernels,xnnpack where installed) unless ``plugins`` names them."""
    command = [str(Path(sys.executable).parent / "llmcore"), "export", "--checkpoint", str(gguf),
               *(["--plugins", plugins] if plugins else []),
               "--max-seq-len", str(max_seq_len), "--quiet", "-o", str(pte)]
    status, wall, peak, _, err = run_with_peak(command)
    row = {"export_s": wall, "export_peak_mib": peak, "export_status": status}
    if status != 0:
        killed = " (killed: out of memory?)" if status == -9 else ""
        row["export_error"] = f"exit {status}{killed}: " + (err.strip().splitlines() or [""])[-1][:200]
    else:
        row["program_mib"] = pte.stat().st_size / MIB
        report = json.loads(pte.with_suffix(".report.json").read_text())
        row["recipe"] = (report.get("quantization") or {}).get("recipe")
        row["kv_cache_mib"] = report["model"]["kv_cache"]["bytes"] / MIB
        row["backends"] = ",".join(b["name"] for b in report["backends"])
        # a layer's module: Llama's ``layers.N``, GPT-2's ``transformer.h.N``
        row["kernel_layers"] = sum(re.fullmatch(r"(layers|transformer\.h)\.\d+", name) is not None
                                   for t in report.get("taken", []) for name in t["taken"])
    return row


def in_view(view: str, command_env: dict | None = None):
    """A context giving the environment of a process run on ISA ``view`` (llmcore/testing/isa_view.py:
    ExecuTorch's and llmcore's kernels picked as on that CPU), then checking, once it ran, that
    the view took effect; the plain environment for ``native``."""
    import contextlib
    import tempfile

    from llmcore.testing import isa_view

    @contextlib.contextmanager
    def context():
        base = dict(command_env or os.environ)
        if view == "native":
            yield base
            return
        with tempfile.TemporaryDirectory() as folder:
            report = Path(folder) / "report"
            yield base | isa_view.executorch_env(view, report)
            isa_view.read_report(report, view)  # raises when the process did not run in the view

    return context()


def cpp_runner(runner: Path, pte: Path, prompt_tokens: int, new_tokens: int, view: str = "native") -> dict:
    with in_view(view) as env:
        status, wall, peak, out, err = run_with_peak(
            [str(runner), str(pte), "--prompt", prompt_text(prompt_tokens), "--max-new-tokens", str(new_tokens),
             "--temperature", "0", "--print-ids"], env=env)
    if status != 0:
        return {"error": f"exit {status}: {err.strip()[-200:]}"}
    ids = next(([int(i) for i in line.split()[1:]] for line in out.splitlines()[::-1] if line.startswith("ids:")), None)
    fields = next((dict(item.split("=", 1) for item in line.split()[1:]) for line in err.splitlines()[::-1]
                   if line.startswith("stats:")), {})
    return {"load_s": float(fields["load_ms"]) / 1000, "peak_mib": peak, "prefill_tok_s": float(fields["prefill_tok_s"]),
            "decode_tok_s": float(fields["decode_tok_s"]), "ids": ids, "prompt_tokens": int(fields["prompt_tokens"])}


def python_worker() -> None:
    """``--worker``: load the program as ``llmcore.load`` does, generate greedily, print JSON.
    ``load_s`` runs from before ``import llmcore`` to the program ready: it includes importing
    torch and ExecuTorch, as a user's first call does (the C++ runner's is its ``load_ms``:
    the program alone, the process already started)."""
    request = json.loads(sys.stdin.read())
    start = time.perf_counter()
    import llmcore

    model = llmcore.load(request["pte"])
    load_s = time.perf_counter() - start
    reply = model.generate(prompt_text(request["prompt_tokens"]), request["new_tokens"])
    print(json.dumps({"load_s": load_s, "prefill_tok_s": reply.stats.prefill_tok_s,
                      "decode_tok_s": reply.stats.decode_tok_s, "ids": reply.generated_ids,
                      "prompt_tokens": len(reply.prompt_ids)}))


def python_runtime(pte: Path, prompt_tokens: int, new_tokens: int, view: str = "native") -> dict:
    request = json.dumps({"pte": str(pte), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens})
    # OMP_NUM_THREADS=1: as `llmcore run` sets it (llmcore/cli.py)
    with in_view(view, dict(os.environ, OMP_NUM_THREADS="1")) as env:
        status, _, peak, out, err = run_with_peak([sys.executable, __file__, "--worker"], env=env, stdin=request)
    if status != 0:
        return {"error": f"exit {status}: {err.strip()[-200:]}"}
    return json.loads(out.strip().splitlines()[-1]) | {"peak_mib": peak}


def checked(pte: Path, run: dict, prompt_tokens: int, label: str) -> dict:
    """``run`` with ``refused`` set when its ids are not Python's choices on the same program."""
    from llmcore.runtime.agreement import RunnerRun, follow

    if "error" in run:
        return run | {"refused": run["error"]}
    agreement = follow(pte, prompt_text(prompt_tokens), RunnerRun(run["ids"], stats={"prompt_tokens": run["prompt_tokens"]}),
                       label=label)
    if not agreement.agrees:
        print(f"# row refused, its tokens are not Python's: {agreement.line()}", file=sys.stderr, flush=True)
        return run | {"refused": agreement.line()}
    return run


def median_runs(runs: list[dict]) -> dict:
    good = [r for r in runs if "refused" not in r]
    if len(good) < len(runs):
        return next(r for r in runs if "refused" in r)
    keys = ("load_s", "peak_mib", "prefill_tok_s", "decode_tok_s")
    return {k: statistics.median(r[k] for r in good) for k in keys} | {
        "min_max": {k: (min(r[k] for r in good), max(r[k] for r in good)) for k in keys}}


def paired_ratios(python: list[dict], cpp: list[dict], python_long: list[dict], cpp_long: list[dict]) -> dict:
    """Python's speed over the C++ runner's in each round (issue 60: within 5%), median of the
    rounds: prefill of the short and the long prompt, decode. Rounds with a refused run are left out."""
    def median_of(a_runs, b_runs, key):
        pairs = [a[key] / b[key] for a, b in zip(a_runs, b_runs) if "refused" not in a and "refused" not in b]
        return statistics.median(pairs) if pairs else None

    return {"prefill": median_of(python, cpp, "prefill_tok_s"),
            "prefill_long": median_of(python_long, cpp_long, "prefill_tok_s"),
            "decode": median_of(python, cpp, "decode_tok_s")}


def llama_cpp(gguf: Path, prompt_tokens: int, long_prompt: int, new_tokens: int, threads: int, repeat: int,
              view: str = "native") -> dict:
    binary = llamacpp_peer.llama_bench_path()
    status, _, peak, out, err = run_with_peak(
        [str(binary), "-m", str(gguf), "-p", f"{prompt_tokens},{long_prompt}", "-n", str(new_tokens), "-t", str(threads),
         "-r", str(repeat), "-o", "json"], env=dict(os.environ) | llamacpp_peer.view_env(view))
    if status != 0:
        return {"error": f"exit {status}: {err.strip()[-200:]}"}
    result = {"peak_mib": peak}
    for row in json.loads(out):
        key = f"prefill{row['n_prompt']}_tok_s" if row.get("n_prompt") else "decode_tok_s"
        result[key] = row["avg_ts"]
    return result


def measure_size(name: str, args) -> dict:
    shape = real_shapes.SHAPES[name]
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    gguf = cache / f"{name}.{WRITTEN_TYPE}.gguf"
    if not gguf.is_file():
        real_shapes.write(name, gguf)
    if args.gguf_type != WRITTEN_TYPE:
        gguf = llamacpp_peer.requantize(gguf, args.gguf_type, cache)
    row = {"size": name, "gguf_type": args.gguf_type, "parameters_b": shape.parameters() / 1e9,
           "gguf_mib": gguf.stat().st_size / MIB}
    pte = cache / name / (f"{name}.pte" if args.gguf_type == WRITTEN_TYPE else f"{name}.{args.gguf_type}.pte")
    pte.parent.mkdir(exist_ok=True)
    print(f"# {name}: exporting {gguf.name} ...", file=sys.stderr, flush=True)
    row |= export(name, gguf, pte, args.long_prompt + args.new_tokens, args.plugins)
    if row["export_status"] != 0:
        return row
    bench_decode.EMBEDDINGS[name] = (shape.vocab, shape.dim)
    step_bytes = bench_decode.weight_bytes_per_token(pte, name)
    runner = Path(args.runner)
    runs = {"c++": lambda p: cpp_runner(runner, pte, p, args.new_tokens, args.isa_view),
            "python": lambda p: python_runtime(pte, p, args.new_tokens, args.isa_view)}
    # Rounds alternate the runners, so that a slow spell of a shared machine slows both sides of
    # a round and the Python/C++ ratio is paired by round (as bench_decode's rows are).
    short = {label: [] for label in runs}
    long = {label: [] for label in runs}
    # The bandwidth read at each round's start, the limit from their median (as bench_decode:
    # one reading at the start of a run was not enough on a shared VM)
    bandwidth_runs = []
    for round_ in range(args.repeat):
        print(f"# {name}: round {round_ + 1} of {args.repeat} ...", file=sys.stderr, flush=True)
        bandwidth_runs.append(bench_decode.memory_bandwidth_gbs())
        for label, run in runs.items():
            short[label].append(checked(pte, run(args.prompt_tokens), args.prompt_tokens, f"{name} ({label})"))
            long[label].append(checked(pte, run(args.long_prompt), args.long_prompt, f"{name} ({label}, long prompt)"))
    for label in runs:
        long_run = median_runs(long[label])
        row[label] = median_runs(short[label]) | {"prefill_long_tok_s": long_run.get("prefill_tok_s"),
                                                  "refused_long": long_run.get("refused")}
    row["bandwidth_gbs_runs"] = bandwidth_runs
    row["bandwidth_limit_tok_s"] = statistics.median(bandwidth_runs) * 1e9 / step_bytes
    row["python_over_cpp"] = paired_ratios(short["python"], short["c++"], long["python"], long["c++"])
    if args.llama_cpp != "off":
        print(f"# {name}: llama.cpp ...", file=sys.stderr, flush=True)
        row["llama_cpp"] = llama_cpp(gguf, args.prompt_tokens, args.long_prompt, args.new_tokens, args.threads,
                                     args.repeat, args.isa_view)
    return row


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def table(rows: list[dict], args) -> str:
    from tabulate import tabulate

    lines = []
    for r in rows:
        on = f" ({r['backends'] or 'portable'}: {r['kernel_layers']} layers on kernels)" if "backends" in r else ""
        base = [r["size"] + on, f"{r['parameters_b']:.2f}", f"{r['gguf_mib']:.0f}"]
        if r["export_status"] != 0:
            lines.append(base + [f"{r['export_s']:.0f}", f"{r['export_peak_mib']:.0f}", r["export_error"]] + [""] * 9)
            continue
        export_cols = [f"{r['export_s']:.0f}", f"{r['export_peak_mib']:.0f} ({ratio(r['export_peak_mib'], r['gguf_mib'])})",
                       f"{r['program_mib']:.0f} ({ratio(r['program_mib'], r['gguf_mib'])})"]
        peer = r.get("llama_cpp") or {}
        for label in ("c++", "python"):
            run = r[label]
            if "refused" in run:
                lines.append(base + export_cols + [label, "refused: " + run["refused"][:80]] + [""] * 7)
                continue
            short = f"prefill{args.prompt_tokens}_tok_s"
            lines.append(base + export_cols + [
                label, f"{run['load_s']:.2f}", f"{run['peak_mib']:.0f}",
                f"{run['prefill_tok_s']:.1f} ({ratio(run['prefill_tok_s'], peer.get(short))})",
                f"{run['prefill_long_tok_s'] or 0:.1f} ({ratio(run['prefill_long_tok_s'], peer.get(f'prefill{args.long_prompt}_tok_s'))})",
                f"{run['decode_tok_s']:.1f} ({ratio(run['decode_tok_s'], peer.get('decode_tok_s'))})",
                f"{r['bandwidth_limit_tok_s']:.1f} ({run['decode_tok_s'] / r['bandwidth_limit_tok_s']:.0%})"])
            base = ["", "", ""]
            export_cols = ["", "", ""]
        paired = r.get("python_over_cpp") or {}
        if all(paired.get(k) for k in ("prefill", "prefill_long", "decode")):
            lines.append(["", "", "", "", "", "", "python / c++, paired", "", "", f"{paired['prefill']:.2f}",
                          f"{paired['prefill_long']:.2f}", f"{paired['decode']:.2f}", ""])
        if peer and "error" not in peer:
            lines.append(["", "", "", "", "", "", f"llama.cpp {args.gguf_type}", "", f"{peer['peak_mib']:.0f}",
                          f"{peer.get(f'prefill{args.prompt_tokens}_tok_s', 0):.1f}",
                          f"{peer.get(f'prefill{args.long_prompt}_tok_s', 0):.1f}", f"{peer['decode_tok_s']:.1f}", ""])
    headers = ["size", "params B", "GGUF MiB", "export s", "export peak MiB (x GGUF)", "program MiB (x GGUF)", "runner",
               "load s (Python: with imports)", "peak RSS MiB", f"prefill {args.prompt_tokens} tok/s (x llama.cpp)",
               f"prefill {args.long_prompt} tok/s (x llama.cpp)", "decode tok/s (x llama.cpp)", "bw limit (of it)"]
    return tabulate(lines, headers=headers)


# Issue 61's targets for this machine kind ("Targets"), by size where the issue names one:
# the export's most wall seconds, peak RSS and program over the GGUF's size
EXPORT_TARGETS = {"llama-3.2-1b": (60, 2.0, None), "llama-3.1-8b": (360, 1.5, 1.1)}
# decode against llama.cpp Q4_0 on the same file, and of the bandwidth limit
DECODE_TARGETS = {"llama-3.2-1b": (1.1, None), "llama-3.2-3b": (1.1, 0.85), "llama-3.1-8b": (1.0, 0.85)}
LOAD_TARGETS = {"llama-3.1-8b": 30.0}  # most seconds to load the program (warm page cache)
# at every size: prefill against llama.cpp (short prompt, long prompt); each runner's peak RSS
# within 1.15x the program and its KV cache, the Python runtime's with 600 MiB more
PREFILL_TARGETS = (1.5, 1.0)
RSS_OVER_PROGRAM, PYTHON_RSS_ALLOWANCE_MIB = 1.15, 600


def target_verdicts(rows: list[dict], args) -> list[tuple[str, str, str, str, str]]:
    """Each row against issue 61's targets: (size, target, row, figure, verdict), the verdict
    met, MISSED, or "-" for a ratio whose peer did not run."""
    lines = []

    def judge(size: str, target: str, row: str, figure, met) -> None:
        lines.append((size, target, row, figure, "-" if met is None else "met" if met else "MISSED"))

    for r in rows:
        size = r["size"]
        if r["export_status"] != 0:
            judge(size, "export completes", "export", r.get("export_error", "")[:60], False)
            continue
        if size in EXPORT_TARGETS:
            most_s, most_peak, most_program = EXPORT_TARGETS[size]
            judge(size, f"export <= {most_s} s", "export", f"{r['export_s']:.0f} s", r["export_s"] <= most_s)
            peak = r["export_peak_mib"] / r["gguf_mib"]
            judge(size, f"export peak RSS <= {most_peak}x the GGUF", "export", f"{peak:.2f}x", peak <= most_peak)
            if most_program is not None:
                program = r["program_mib"] / r["gguf_mib"]
                judge(size, f"program <= {most_program}x the GGUF", "export", f"{program:.2f}x", program <= most_program)
        peer = r.get("llama_cpp") or {}
        peer = {} if "error" in peer else peer
        for label in ("c++", "python"):
            run = r[label]
            if "refused" in run or "error" in run:
                judge(size, "tokens checked", label, (run.get("refused") or run.get("error"))[:60], False)
                continue
            allowed = RSS_OVER_PROGRAM * (r["program_mib"] + r["kv_cache_mib"])
            allowed += PYTHON_RSS_ALLOWANCE_MIB if label == "python" else 0
            extra = f" + {PYTHON_RSS_ALLOWANCE_MIB} MiB" if label == "python" else ""
            judge(size, f"peak RSS <= {RSS_OVER_PROGRAM}x (program + KV cache){extra}", label,
                  f"{run['peak_mib']:.0f} of {allowed:.0f} MiB", run["peak_mib"] <= allowed)
            for tokens, key, least in ((args.prompt_tokens, "prefill_tok_s", PREFILL_TARGETS[0]),
                                       (args.long_prompt, "prefill_long_tok_s", PREFILL_TARGETS[1])):
                theirs = peer.get(f"prefill{tokens}_tok_s")
                x = run[key] / theirs if run.get(key) and theirs else None
                judge(size, f"prefill {tokens} >= {least}x llama.cpp", label, "-" if x is None else f"{x:.2f}x",
                      None if x is None else x >= least)
            if size in DECODE_TARGETS:
                least, share = DECODE_TARGETS[size]
                theirs = peer.get("decode_tok_s")
                x = run["decode_tok_s"] / theirs if theirs else None
                judge(size, f"decode >= {least}x llama.cpp", label, "-" if x is None else f"{x:.2f}x",
                      None if x is None else x >= least)
                if share is not None:
                    of_limit = run["decode_tok_s"] / r["bandwidth_limit_tok_s"]
                    judge(size, f"decode >= {share:.0%} of the bw limit", label, f"{of_limit:.0%}", of_limit >= share)
            if size in LOAD_TARGETS:
                judge(size, f"load < {LOAD_TARGETS[size]:.0f} s", label, f"{run['load_s']:.2f} s",
                      run["load_s"] < LOAD_TARGETS[size])
    return lines


def targets(rows: list[dict], args) -> str:
    from tabulate import tabulate

    return tabulate(target_verdicts(rows, args), headers=["size", "target", "row", "figure", "verdict"])


def plot(rows: list[dict], path: Path) -> None:
    """Export time and memory, program size and decode speed against parameter count."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# --plot needs matplotlib: pip install matplotlib", file=sys.stderr)
        return
    done = [r for r in rows if r["export_status"] == 0]
    params = [r["parameters_b"] for r in done]
    figure, (memory, speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    memory.plot(params, [r["gguf_mib"] / 1024 for r in done], "o-", label="GGUF file")
    memory.plot(params, [r["program_mib"] / 1024 for r in done], "o-", label="program")
    memory.plot(params, [r["export_peak_mib"] / 1024 for r in done], "o-", label="export peak RSS")
    for label in ("c++", "python"):
        memory.plot(params, [r[label].get("peak_mib", float("nan")) / 1024 for r in done], "o--", label=f"{label} peak RSS")
    memory.set(xlabel="parameters (billions)", ylabel="GiB", title="memory")
    memory.legend(fontsize=8)
    speed.plot(params, [r["export_s"] for r in done], "o-", label="export wall s")
    for label in ("c++", "python"):
        speed.plot(params, [r[label].get("decode_tok_s", float("nan")) for r in done], "o--", label=f"{label} decode tok/s")
    speed.plot(params, [(r.get("llama_cpp") or {}).get("decode_tok_s", float("nan")) for r in done], "o:",
               label="llama.cpp decode tok/s")
    speed.set(xlabel="parameters (billions)", title="time")
    speed.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    print(f"# plot: {path}", file=sys.stderr)


def main() -> None:
    if sys.argv[1:] == ["--worker"]:
        python_worker()
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="llama-300m,llama-3.2-1b",
                        help=f"comma-separated, of: {', '.join(real_shapes.SHAPES)}")
    parser.add_argument("--cache", default=str(ROOT / ".cache" / "bench" / "scale"), help="GGUFs and programs")
    parser.add_argument("--runner", default=str(ROOT / "build" / "llmcore_runner"))
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--long-prompt", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--llama-cpp", choices=("auto", "off"), default="auto",
                        help="auto: build llama.cpp's llama-bench (benchmarks/llamacpp_peer.py) if missing")
    parser.add_argument("--plugins", default="",
                        help="backends for the export (default: none named, so the export's default list, as a user "
                        "gets it; e.g. xnnpack for XNNPACK alone)")
    parser.add_argument("--isa-view", default="native",
                        help="run the runners and llama.cpp as on a CPU with fewer features (avx2: without AVX-512 "
                        "and VNNI, the AVX2-only EPYC's kernels; avxvnni: an Intel laptop core's; avx512: without "
                        "AMX; llmcore/testing/isa_view.py); the export is the same")
    parser.add_argument("--gguf-type", default=WRITTEN_TYPE,
                        help="the GGUF's type: Q4_0 (real_shapes.py's file), or one llama-quantize makes from it "
                        "(Q4_K_M, Q4_1, Q8_0 ...)")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in real_shapes.SHAPES]
    if unknown:
        parser.error(f"unknown size {unknown[0]!r}; choose from {', '.join(real_shapes.SHAPES)}")
    print(bench_decode.machine_header())
    if args.isa_view != "native":
        from llmcore.testing import isa_view

        isa_view.check_view(args.isa_view)
        print(f"# ISA view {args.isa_view}: the runners and llama.cpp run as if the CPU lacked "
              f"{', '.join(isa_view.VIEWS[args.isa_view])}")
    bandwidth = bench_decode.memory_bandwidth_gbs()
    print(f"memory read bandwidth here: {bandwidth:.1f} GB/s ({os.cpu_count()} threads)")
    if args.llama_cpp == "auto":
        llamacpp_peer.build_llama_bench()
    if args.gguf_type != WRITTEN_TYPE and not llamacpp_peer.tool_path("llama-quantize").is_file():
        parser.error(f"--gguf-type {args.gguf_type} is made by llama.cpp's llama-quantize, which is not built: "
                     "python benchmarks/llamacpp_peer.py build (or leave --llama-cpp auto)")
    rows = []
    for name in sizes:
        rows.append(measure_size(name, args))
        if args.json:  # kept as the run goes: a later size killed for memory loses nothing
            Path(args.json).write_text(json.dumps({"bandwidth_gbs": bandwidth, "rows": rows}, indent=2))
    print(f"\n## cost by size ({args.gguf_type} GGUFs; {args.prompt_tokens}- and {args.long_prompt}-token prompts, "
          f"{args.new_tokens} new tokens, greedy, median of {args.repeat} rounds alternating the runners; every runner's tokens checked against Python's)")
    print(table(rows, args))
    for r in rows:
        if r.get("bandwidth_gbs_runs"):
            print(f"# {r['size']}: memory read bandwidth at each round's start "
                  f"{' '.join(f'{b:.1f}' for b in r['bandwidth_gbs_runs'])} GB/s; its bw limit from their median")
    if args.gguf_type == WRITTEN_TYPE:
        print("\n## issue 61's targets (for the AVX2-only EPYC; ratios of medians, llama.cpp from its own run)")
        print(targets(rows, args))
    else:
        print(f"\n# no verdicts: issue 61 states its targets for Q4_0 files, not {args.gguf_type}")
    if args.plot:
        plot(rows, Path(args.plot))


if __name__ == "__main__":
    main()
