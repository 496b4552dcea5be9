"""4-bit quality next to llama.cpp's: perplexity, size and speed of SmolLM2-135M, one run.

From the shipped Q4_1 GGUF it makes llmcore's programs (recipes ``8da8w``, ``gguf``,
``gguf`` with ``outlier_split=true``, ``8da4w`` and its ``asymmetric`` form; ``--recipes``
picks some) and llama.cpp's Q4_0 and Q8_0 (``llama-quantize --allow-requantize``), then
prints for each:

* perplexity by llama.cpp's ``llama-perplexity`` protocol (chunks of ``--ctx`` tokens, the
  second half of each scored): ``llmcore eval --protocol llama-perplexity`` for the
  programs, ``llama-perplexity`` itself for the GGUF files, on the same text;
* the loss against the fp32 reference of each side (llmcore's eager model from the
  dequantized GGUF; llama.cpp's shipped Q4_1, the file everything is made from), and the
  mean KL divergence of the next-token distributions from that reference over the scored
  positions (``llmcore eval``'s; ``llama-perplexity --kl-divergence`` against the shipped
  file's logits), which unlike a perplexity difference on a few hundred tokens is not moved
  by the rounding noise;
* file size, prefill and decode tok/s (llmcore's C++ runner and Python runtime,
  ``llama-bench``).

    .venv/bin/python benchmarks/bench_quality.py --llama-cpp build
    .venv/bin/python benchmarks/bench_quality.py --ctx 256 --text benchmarks/data/alice-chapter1.txt

The absolute perplexities of the two sides differ a little (tokenization of the chunk
boundaries, float order); the losses compare. Run nothing else beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import llamacpp_peer as llama_cpp  # noqa: E402
from bench_decode import follow_runner, machine_header, run_cpp_runner, run_worker, smollm2_path  # noqa: E402

RECIPES = {
    "8da8w": ["--quantize", "8da8w"],
    "8da8w no-awq": ["--quantize", "8da8w", "--quantize-option", "awq=false"],
    "8da8w min/max": ["--quantize", "8da8w", "--quantize-option", "activation_aware=false",
                      "--quantize-option", "awq=false"],
    "gguf": ["--quantize", "gguf"],
    "gguf outlier_split": ["--quantize", "gguf", "--quantize-option", "outlier_split=true"],
    "8da4w": ["--quantize", "8da4w"],
    "8da4w no-awq": ["--quantize", "8da4w", "--quantize-option", "awq=false"],
    "8da4w hqq": ["--quantize", "8da4w", "--quantize-option", "activation_aware=false",
                  "--quantize-option", "awq=false"],
    "8da4w fp32 embedding": ["--quantize", "8da4w", "--quantize-option", "embedding_bits=0"],
    "8da4w asymmetric": ["--quantize", "8da4w", "--quantize-option", "asymmetric=true"],
    "8da4w asymmetric group 64": ["--quantize", "8da4w", "--quantize-option", "asymmetric=true",
                                  "--quantize-option", "group_size=64"],
}
PEER_TYPES = ("Q4_0", "Q8_0")


def export(recipe: str, cache: Path, max_seq_len: int, reuse: bool) -> Path:
    """llmcore's program for ``recipe``, exported now (a recipe's defaults change between
    versions; ``--reuse-programs`` takes the cached one, for re-running the speed rounds)."""
    out = cache / f"smollm2-{recipe.replace(' ', '-')}" / "model.pte"
    if not (reuse and out.is_file()):
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "llmcore", "export", "--model", "llama", "--checkpoint", smollm2_path(),
                        "--plugins", "xnnpack", *RECIPES[recipe], "--max-seq-len", str(max_seq_len), "--quiet",
                        "-o", str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


def llmcore_perplexity(pte: Path, text: Path, ctx: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "llmcore", "eval", str(pte), "--text", str(text),
                          "--protocol", "llama-perplexity", "--ctx", str(ctx), "--json"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def llama_cpp_perplexity(gguf: Path, text: Path, ctx: int, base_logits: Path) -> tuple[float, Optional[float]]:
    """``llama-perplexity``'s final estimate for ``gguf``, and its mean KL divergence from the
    logits in ``base_logits`` (None: this is the base, whose logits it writes there)."""
    command = [str(llama_cpp.tool_path("llama-perplexity")), "-m", str(gguf), "-f", str(text),
               "-c", str(ctx), "-b", str(ctx), "-t", str(os.cpu_count() or 1), "--kl-divergence-base", str(base_logits)]
    writes_base = not base_logits.is_file()
    out = subprocess.run(command if writes_base else command + ["--kl-divergence"],
                         check=True, capture_output=True, text=True)
    printed = out.stdout + out.stderr
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", printed) or re.search(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", printed)
    if not found:
        raise SystemExit(f"bench_quality: llama-perplexity printed no perplexity for {gguf}")
    kl = None if writes_base else float(re.search(r"Mean\s+KLD:\s*([0-9.]+)", printed).group(1))
    return float(found.group(1)), kl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default=str(HERE / "data" / "alice-chapter1.txt"))
    parser.add_argument("--ctx", type=int, default=256, help="llama-perplexity's chunk size (-c)")
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3, help="speed rounds; the median is shown")
    parser.add_argument("--cache", default=str(ROOT / ".cache" / "bench-quality"))
    parser.add_argument("--runner", default=str(ROOT / "build" / "llmcore_runner"))
    parser.add_argument("--recipes", default=",".join(RECIPES),
                        help=f"llmcore's recipes to measure, comma-separated (default: all of {', '.join(RECIPES)})")
    parser.add_argument("--reuse-programs", action="store_true",
                        help="use llmcore's programs from an earlier run instead of exporting them again")
    parser.add_argument("--llama-cpp", choices=["auto", "build"], default="auto",
                        help="build = build llama.cpp's tools first (15-25 min on 2 cores)")
    args = parser.parse_args()
    cache, text = Path(args.cache), Path(args.text)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise SystemExit(f"bench_quality: unknown recipe(s) {', '.join(unknown)}; known: {', '.join(RECIPES)}")
    cache.mkdir(parents=True, exist_ok=True)
    if args.llama_cpp == "build":
        llama_cpp.build_llama_bench()
    if not all(llama_cpp.tool_path(t).is_file() for t in llama_cpp.TOOLS):
        raise SystemExit("bench_quality: llama.cpp's tools are not built: run with --llama-cpp build")

    print(machine_header())
    print(f"# text {text.name}, llama-perplexity protocol, ctx {args.ctx}; speed: prompt {args.prompt_tokens} "
          f"tokens, {args.new_tokens} new, median of {args.repeat}")
    rows = []
    reference = None
    for recipe in recipes:
        pte = export(recipe, cache, args.max_seq_len, args.reuse_programs)
        scored = llmcore_perplexity(pte, text, args.ctx)
        if reference is None:
            reference = scored["eager"]["perplexity"]
            rows.append({"what": "llmcore eager fp32 (dequantized GGUF)", "ppl": reference, "reference": reference})
        runner = [run_cpp_runner(Path(args.runner), pte, args) for _ in range(args.repeat)]
        python = [run_worker(str(pte), "smollm2", args) for _ in range(args.repeat)]
        # A runner round whose tokens are not Python's choices is no figure (llmcore/runtime/agreement.py).
        for i, r in enumerate(runner):
            verdict = follow_runner(pte, r, args, label=f"{recipe} (c++ runner)") if r else None
            if verdict is not None and not verdict["agrees"]:
                print(f"# round refused, its tokens are not Python's: {verdict['line']}", file=sys.stderr)
                runner[i] = None
        for label, runs in (("c++ runner", runner), ("python", python)):
            runs = [r for r in runs if r]
            rows.append({
                "what": f"llmcore {recipe} ({label})", "ppl": scored["program"]["perplexity"], "reference": reference,
                "kl": scored["divergence"]["mean_kl"],
                "mib": pte.stat().st_size / 2**20,
                "prefill": statistics.median(r["prefill_tok_s"] for r in runs) if runs else None,
                "decode": statistics.median(r["decode_tok_s"] for r in runs) if runs else None,
            })
    source = Path(smollm2_path())
    base_logits = cache / f"{source.stem}.ctx{args.ctx}.{text.stem}.kld"  # the shipped file's logits
    base_logits.unlink(missing_ok=True)  # written afresh from the shipped file, first
    for kind, gguf in [("Q4_1 (shipped)", source)] + [(k, llama_cpp.requantize(source, k, cache)) for k in PEER_TYPES]:
        ppl, kl = llama_cpp_perplexity(gguf, text, args.ctx, base_logits)
        if gguf == source:
            peer_reference = ppl
        speed = llama_cpp.run_llama_bench(gguf, args.prompt_tokens, args.new_tokens, os.cpu_count() or 1,
                                          repetitions=args.repeat)
        rows.append({"what": f"llama.cpp {kind}", "ppl": ppl, "reference": peer_reference, "kl": kl,
                     "mib": gguf.stat().st_size / 2**20, "prefill": speed["prefill_tok_s"],
                     "decode": speed["decode_tok_s"]})

    print("\n| | perplexity | loss vs its fp32 reference | mean KL vs fp32 | file MiB | prefill tok/s | decode tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        loss = r["ppl"] / r["reference"] - 1
        cells = [f"{r['ppl']:.2f}", f"{loss:+.1%}", f"{r['kl']:.4f}" if r.get("kl") is not None else "-",
                 f"{r['mib']:.1f}" if r.get("mib") else "-",
                 f"{r['prefill']:.1f}" if r.get("prefill") else "-", f"{r['decode']:.1f}" if r.get("decode") else "-"]
        print(f"| {r['what']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
