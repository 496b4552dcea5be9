"""Export benchmark: how long each stage of ``llmcore export`` takes, and how lowering scales.

Each export runs in its own process (so its peak RSS is its own) and the table prints,
per stage, wall time, CPU time and the process's peak RSS when the stage ended, read from
the report the export writes. Then the scaling table: SmolLM2-135M's architecture with
random weights at 4, 8, 16 and 30 layers, 8da4w, with the time each added layer costs
(flat from row to row: lowering is linear in layers). ``--whole-graph`` also exports each
case with ``--whole-graph-lowering``, the path that runs ``to_edge`` on every layer, and
prints the ratio (the programs are the same byte for byte).

    .venv/bin/python benchmarks/bench_export.py
    .venv/bin/python benchmarks/bench_export.py --cases smollm2-gguf,smollm2-8da4w --whole-graph
    .venv/bin/python benchmarks/bench_export.py --cases smollm2-gguf --layers 4,30 --repeat 2
    .venv/bin/python benchmarks/bench_export.py --cases smollm2-8da4w --layers "" --anchor   # + ExecuTorch's export_llama

Machines of one kind differ: the header prints the CPU model and flags, and only figures
from one run compare. Run nothing else while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_decode import machine_header, smollm2_path  # noqa: E402

# case -> (what it is, ExportOptions fields); "checkpoint": "smollm2" is the shipped GGUF
CASES = {
    "smollm2-gguf": ("SmolLM2-135M Q4_1 GGUF, its own integers (the demo)", dict(
        model="llama", checkpoint="smollm2", quantize="gguf")),
    "smollm2-8da4w": ("SmolLM2-135M, 8da4w from the dequantized weights", dict(
        model="llama", checkpoint="smollm2", quantize="8da4w")),
    # "none": float weights (no quantize at all would pick the GGUF's own recipe, gguf)
    "smollm2-fp32": ("SmolLM2-135M, fp32", dict(model="llama", checkpoint="smollm2", quantize="none")),
    "smollm2-int8-dynamic": ("SmolLM2-135M, int8-dynamic (pt2e)", dict(
        model="llama", checkpoint="smollm2", quantize="int8-dynamic")),
    "gpt2-int8-dynamic": ("GPT-2-124M (random weights), int8-dynamic (pt2e)", dict(
        model="nanogpt", config="gpt2", quantize="int8-dynamic")),
    # each family's switches on SmolLM2-135M's shape (random weights), 8da4w: what a family costs
    "llama-135m": ("SmolLM2-135M's shape, random weights, 8da4w", dict(
        model="llama", config="smollm2-135m", quantize="8da4w")),
    **{f"{config}": (f"{config} (SmolLM2-135M's shape, {family}'s switches, random weights), 8da4w", dict(
        model=family, config=config, quantize="8da4w"))
       for family, config in (("qwen", "qwen2-135m"), ("qwen", "qwen3-135m"), ("phi", "phi4-mini-135m"),
                              ("gemma", "gemma2-135m"), ("gemma", "gemma3-135m"), ("mistral", "mistral-135m"))},
}
DEFAULT_CASES = [c for c in CASES if not c.endswith("-135m")]  # the families: ask with --cases
STAGES = ("load", "transform", "quantize", "export", "lower", "post-passes", "emit", "parity")


def run_one(spec: dict) -> None:
    """In a fresh process: one export, with ``layers`` (if given) replacing the config's count,
    the process set up as the ``llmcore export`` command sets up its own."""
    import dataclasses

    from llmcore.cli import one_openmp_thread_per_worker, torch_on_every_core

    if one_openmp_thread_per_worker():  # before torch is imported
        torch_on_every_core()  # the export's eager work on every core
    from llmcore.pipeline import export
    from llmcore.recipe import ExportOptions

    layers = spec.pop("layers", None)
    if layers:
        from llmcore_llama import config

        config.CONFIGS[spec["config"]] = dataclasses.replace(config.CONFIGS[spec["config"]], n_layers=layers)
    if spec.get("config", "").endswith("-135m"):  # SmolLM2's vocabulary
        spec["tokenizer"] = smollm2_tokenizer(Path(spec["output"]).parent)
    if spec.get("checkpoint") == "smollm2":
        spec["checkpoint"] = smollm2_path()
    export(ExportOptions(plugins=["xnnpack"], max_seq_len=1024, quiet=True, **spec))
    from llmcore.cli import freeze_before_exit

    freeze_before_exit()  # the process ends as the llmcore command's does


def smollm2_tokenizer(folder: Path) -> str:
    """SmolLM2's tokenizer.json, from the GGUF's metadata (random-weight exports need one)."""
    from llmcore_llama.loaders import GGUFFile
    from llmcore_llama.tokenization import tokenizer_from_gguf_fields

    path = folder / "smollm2-tokenizer.json"
    path.write_text(tokenizer_from_gguf_fields(GGUFFile(Path(smollm2_path())).get).json_text)
    return str(path)


# ---- the anchor: ExecuTorch's own LLM export on the same weights and recipe ----------------


def write_meta_checkpoint(folder: Path) -> tuple[Path, Path]:
    """SmolLM2-135M's weights (the shipped GGUF, dequantized by llmcore's loader: the same
    floats llmcore's 8da4w export starts from) as ExecuTorch's llama example reads them: a
    Meta-layout state dict and its params.json. Tied embeddings get their own output.weight,
    as ExecuTorch's SmolLM2 converter writes it."""
    import torch

    from llmcore.pipeline.load import load_model
    from llmcore.pipeline.plan import resolve_plan
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions

    options = ExportOptions(model="llama", checkpoint=smollm2_path(), plugins=["xnnpack"], quantize="8da4w",
                            output=str(folder / "unused.pte"))
    loaded = load_model(resolve_plan(options, load_registry()), floats=True)
    config = loaded.module.config
    state = {k: v.contiguous() for k, v in loaded.module.state_dict().items()
             if k == "output.weight" or k.startswith(("tok_embeddings.", "layers.", "norm."))}
    state.setdefault("output.weight", state["tok_embeddings.weight"])
    params = dict(dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
                  vocab_size=config.vocab_size, hidden_dim=config.hidden_dim, norm_eps=config.norm_eps,
                  rope_theta=config.rope_theta, use_scaled_rope=False)
    checkpoint, params_path = folder / "smollm2-135m.pth", folder / "smollm2-135m.params.json"
    torch.save(state, checkpoint)
    params_path.write_text(json.dumps(params))
    return checkpoint, params_path


def run_anchor(spec: dict) -> None:
    """In a fresh process: ExecuTorch's ``export_llama`` (what ``export_llm`` runs, called
    with its config object rather than through hydra, which the wheel does not install),
    8da4w with group 32, KV cache with ExecuTorch's SDPA op, XNNPACK, 1024 positions:
    llmcore's smollm2-8da4w case, as ExecuTorch's own tool makes it."""
    from executorch.examples.models.llama.export_llama_lib import export_llama
    from executorch.extension.llm.export.config.llm_config import LlmConfig, ModelType

    config = LlmConfig()
    config.base.model_class = ModelType.smollm2
    config.base.checkpoint, config.base.params = spec["checkpoint"], spec["params"]
    config.model.use_kv_cache = config.model.use_sdpa_with_kv_cache = config.model.enable_dynamic_shape = True
    config.export.max_seq_length = config.export.max_context_length = 1024
    # output_name is the path written (output_dir is not prefixed to it)
    config.export.output_dir = spec["output_dir"]
    config.export.output_name = str(Path(spec["output_dir"]) / "anchor.pte")
    config.quantization.qmode, config.quantization.group_size = "8da4w", 32
    config.backend.xnnpack.enabled = True
    export_llama(config)


def measure_anchor(workdir: Path) -> dict:
    checkpoint, params = write_meta_checkpoint(workdir)
    spec = {"checkpoint": str(checkpoint), "params": str(params), "output_dir": str(workdir)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--anchor-one", json.dumps(spec)], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"bench_export: ExecuTorch's export_llama failed:\n{done.stderr[-3000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest child so far
    size = (workdir / "anchor.pte").stat().st_size
    for path in workdir.iterdir():
        path.unlink()
    return {"process_s": wall, "pte_mib": size / 2**20, "children_peak_mib": peak}


def measure(spec: dict, workdir: Path) -> dict:
    """Runs one export in a subprocess; its report's stages, total wall time and .pte size."""
    out = workdir / f"m{time.monotonic_ns()}.pte"
    spec = {**spec, "output": str(out)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"bench_export: the export {spec} failed:\n{done.stderr[-3000:]}")
    report = json.loads(out.with_suffix(".report.json").read_text())
    size = out.stat().st_size
    for path in workdir.iterdir():
        path.unlink()
    return {"stages": {s["name"]: s for s in report["stages"]}, "process_s": wall, "pte_mib": size / 2**20}


def median_run(runs: list[dict]) -> dict:
    """The run with the median total: its stages stay consistent with each other."""
    ordered = sorted(runs, key=lambda r: r["process_s"])
    return ordered[(len(ordered) - 1) // 2]


def stage_table(name: str, description: str, runs: list[dict]) -> str:
    run = median_run(runs)
    lines = [f"## {name}: {description}"]
    totals = [r["process_s"] for r in runs]
    spread = f" (min {min(totals):.1f} s, median of {len(runs)})" if len(runs) > 1 else ""
    lines.append(f"process wall {run['process_s']:.1f} s{spread}, .pte {run['pte_mib']:.1f} MiB")
    lines.append("| stage | wall s | cpu s | peak RSS MiB |")
    lines.append("|---|---:|---:|---:|")
    for stage in STAGES:
        s = run["stages"].get(stage)
        if s:
            lines.append(f"| {stage} | {s['wall_s']:.1f} | {s.get('cpu_s', 0):.1f} | {s['peak_rss_mib']:.0f} |")
    return "\n".join(lines)


def baseline_line(runs: list[dict], whole: list[dict]) -> str:
    """The same case with ``--whole-graph-lowering``: how much converting two blocks saves."""
    lower = min(r["stages"]["lower"]["wall_s"] for r in runs)
    whole_lower = min(r["stages"]["lower"]["wall_s"] for r in whole)
    total = min(r["process_s"] for r in runs)
    whole_total = min(r["process_s"] for r in whole)
    return (
        f"with --whole-graph-lowering (to_edge on every layer): lower {whole_lower:.1f} s, process "
        f"{whole_total:.1f} s; two blocks and copies are {whole_lower / lower:.2f}x faster to lower, "
        f"{whole_total / total:.2f}x for the export (min of {len(runs)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--anchor-one", help=argparse.SUPPRESS)
    parser.add_argument(
        "--anchor", action="store_true",
        help="also run ExecuTorch's own export_llama (the wheel's) on SmolLM2 8da4w, for the ratio (slow: ~25 min)",
    )
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma-separated, of: {', '.join(CASES)} (default: {', '.join(DEFAULT_CASES)})")
    parser.add_argument("--layers", default="4,8,16,30", help="layer counts for the scaling table ('' skips it)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each export; the median is shown")
    parser.add_argument(
        "--whole-graph", action="store_true",
        help="also export each case with --whole-graph-lowering (to_edge on every layer), for the ratio",
    )
    args = parser.parse_args()
    if args.one:
        run_one(json.loads(args.one))
        return
    if args.anchor_one:
        run_anchor(json.loads(args.anchor_one))
        return

    print(machine_header())
    print(f"# nproc {os.cpu_count()}; every export in its own process, one at a time\n")
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        workdir = Path(tmp)
        for name in [c for c in args.cases.split(",") if c]:
            if name not in CASES:
                raise SystemExit(f"bench_export: unknown case {name!r}; choose from {', '.join(CASES)}")
            description, spec = CASES[name]
            runs = [measure(spec, workdir) for _ in range(args.repeat)]
            print(stage_table(name, description, runs), flush=True)
            if args.anchor and name == "smollm2-8da4w":
                anchor = measure_anchor(workdir)
                ours = min(r["process_s"] for r in runs)
                print(f"ExecuTorch's export_llama, same weights and recipe: {anchor['process_s']:.1f} s "
                      f"(.pte {anchor['pte_mib']:.1f} MiB, largest child peak RSS {anchor['children_peak_mib']:.0f} MiB); "
                      f"llmcore is {anchor['process_s'] / ours:.1f}x faster", flush=True)
            if args.whole_graph:
                whole = [measure({**spec, "whole_graph_lowering": True}, workdir) for _ in range(args.repeat)]
                print(baseline_line(runs, whole), flush=True)
            print(flush=True)

        layers = [int(n) for n in args.layers.split(",") if n]
        if layers:
            print("## lowering vs layers: SmolLM2-135M's architecture, random weights, 8da4w")
            print("| layers | lower s (min) | lower s / layers | s per added layer | export s | peak RSS MiB |")
            print("|---:|---:|---:|---:|---:|---:|")
            previous = None
            for n in layers:
                spec = dict(model="llama", config="smollm2-135m", quantize="8da4w", layers=n)
                runs = [measure(spec, workdir) for _ in range(args.repeat)]
                lower = min(r["stages"]["lower"]["wall_s"] for r in runs)
                # The marginal cost of a layer: what lowering would cost per layer without its
                # fixed part. Flat from row to row means linear in layers.
                added = f"{(lower - previous[1]) / (n - previous[0]):.2f}" if previous else ""
                previous = (n, lower)
                run = median_run(runs)
                peak = max(s["peak_rss_mib"] for s in run["stages"].values())
                print(f"| {n} | {lower:.1f} | {lower / n:.2f} | {added} | "
                      f"{statistics.median(r['process_s'] for r in runs):.1f} | {peak:.0f} |", flush=True)


if __name__ == "__main__":
    main()
