"""What a JSON-schema constraint costs decode: the same program generating with and without
a grammar (llguidance) over its logits, in the Python generation loop ``run``, ``serve``
and ``chat`` share.

For each program: greedy decode of up to ``--new-tokens`` tokens after a short prompt,
unconstrained (EOS ignored) and constrained to a schema whose one string field lets the
model write on; rounds alternate, medians are printed, with the time the mask took per
token, how many tokens needed the full mask (the others were the model's own pick, which
the grammar allowed) and how many the grammar forced (fed with the prompt or with the
sampled token, no forward pass of their own; decode speed is timed after the first sampled
token, so the forced opening counts as prompt time; the free run is given the same opening
in its prompt, so both decode at the same positions). The ratio is the median of each
round's own ratio; the same with fast-forward off is printed beside it. Each program runs
in a process of its own with the thread count `llmcore run` and `serve` give it by default
(one thread under 16 MiB). Target (issue): constrained decode >= 90% of unconstrained.

    .venv/bin/python benchmarks/bench_constrained.py                      # tiny nanoGPT + SmolLM2
    .venv/bin/python benchmarks/bench_constrained.py --smollm2 path/to/smollm2.pte
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_decode import machine_header, smollm2_path  # noqa: E402

# the tiny model decodes 96 tokens in about 10 ms: more rounds, or the median is noise
TINY_ROUNDS = 17
# minLength keeps the model writing: a story it may not end before the token budget
SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}}, "required": ["story"]}


def export(args: list[str], out: Path) -> Path:
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "llmcore", "export", *args, "--quiet", "-o", str(out)], check=True,
                       stdout=subprocess.DEVNULL)
    return out


def measure(pte: Path, prompt: str, new_tokens: int, rounds: int) -> dict:
    import torch

    from llmcore.runtime.constrain import Constraint, json_schema_grammar
    from llmcore.runtime.generate import Sampling, TextTokenizer, generate, prompt_ids_for
    from llmcore.runtime import Program

    torch.set_num_threads(1)  # as the CLI: the program computes on the runtime's own pool
    program = Program.load(pte)
    tokenizer = TextTokenizer.from_file(pte.with_name("tokenizer.json"))
    ids = prompt_ids_for(program, tokenizer, prompt)
    vocab = int(program.metadata.get("get_vocab_size") or tokenizer.vocab_size)
    grammar = json_schema_grammar(SCHEMA)
    # The grammar's opening (`{"story": "`) goes into the constrained run's prompt call, so its
    # decode runs at later positions, where attention reads a longer cache. The free run gets
    # the same opening in its prompt and as many new tokens, so both decode at the same
    # positions and the ratio is the grammar's cost alone.
    opening = Constraint(grammar, tokenizer.json_text, program.eos_ids, vocab).forced()
    free_ids, free_new = ids + opening, new_tokens - len(opening)
    free, bound, plain, ratio, plain_ratio, mask_ms, masked_pct, forced, lengths = ([] for _ in range(9))
    for _ in range(rounds):
        out = generate(program, free_ids, free_new, Sampling(), stop_at_eos=False)
        free.append(out.stats.decode_tok_s)
        constraint = Constraint(grammar, tokenizer.json_text, program.eos_ids, vocab)
        out = generate(program, ids, new_tokens, Sampling(), constraint=constraint)
        bound.append(out.stats.decode_tok_s)
        mask_ms.append(1000 * constraint.mask_seconds / max(1, len(out.generated_ids)))
        masked_pct.append(100 * constraint.masks / max(1, constraint.tokens))
        forced.append(constraint.forced_tokens)
        lengths.append(len(out.generated_ids))
        no_ff = Constraint(grammar, tokenizer.json_text, program.eos_ids, vocab, fast_forward=False)
        plain.append(generate(program, ids, new_tokens, Sampling(), constraint=no_ff).stats.decode_tok_s)
        # each round's own ratio: the machine's drift between rounds cancels out
        ratio.append(bound[-1] / free[-1])
        plain_ratio.append(plain[-1] / free[-1])
    return {"free": statistics.median(free), "bound": statistics.median(bound), "ratio": statistics.median(ratio),
            "plain_ratio": statistics.median(plain_ratio), "ratio_min": min(ratio),
            "mask_ms": statistics.median(mask_ms), "masked_pct": statistics.median(masked_pct),
            "forced": min(forced), "tokens": min(lengths), "vocab": vocab}


def measure_in_child(pte: Path, prompt: str, new_tokens: int, rounds: int) -> dict:
    """:func:`measure` in a process of its own, with the runtime's thread pool as
    ``llmcore run`` and ``serve`` set it when ``--threads`` is not given
    (``llmcore.runtime.default_threads``: one thread for a program under 16 MiB). The pool
    is process-wide, so each program gets a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # as `llmcore run`
    out = subprocess.run([sys.executable, __file__, "--measure", str(pte), prompt, str(new_tokens), str(rounds)],
                         check=True, stdout=subprocess.PIPE, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def _measure_here(pte: str, prompt: str, new_tokens: str, rounds: str) -> int:
    from llmcore.runtime import default_threads, use_threads

    threads = default_threads(pte)
    if threads is not None:
        use_threads(threads)
    result = measure(Path(pte), prompt, int(new_tokens), int(rounds))
    print(json.dumps({**result, "threads": threads or f"one per core ({os.cpu_count()})"}))
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--measure"]:
        return _measure_here(*sys.argv[2:6])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smollm2", help="a SmolLM2 .pte (default: export one from the shipped GGUF)")
    parser.add_argument("--cache", default=str(ROOT / ".cache" / "bench-constrained"))
    args = parser.parse_args()
    cache = Path(args.cache)
    tiny = export(["--model", "nanogpt", "--config", "tiny", "--plugins", "xnnpack"], cache / "tiny" / "tiny.pte")
    smol = Path(args.smollm2) if args.smollm2 else export(
        ["--model", "llama", "--checkpoint", smollm2_path(), "--plugins", "xnnpack", "--max-seq-len", "512"],
        cache / "smollm2" / "smollm2.pte")
    print(machine_header())
    print(f"# greedy, up to {args.new_tokens} new tokens, Python runtime, median of {args.rounds} alternating rounds "
          f"({TINY_ROUNDS * args.rounds} for the tiny model); "
          f"schema {SCHEMA}")
    print("\n| program | vocab | runtime threads | decode tok/s free | with the schema | ratio (min) | ratio without fast-forward | "
          "grammar ms/token | tokens that needed the mask | forced tokens | constrained tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    for name, pte, prompt, rounds in (("tiny nanoGPT", tiny, "Once upon a time", TINY_ROUNDS * args.rounds),
                                      ("SmolLM2-135M gguf", smol, "Write a short story about a cat, as JSON:",
                                       args.rounds)):
        r = measure_in_child(pte, prompt, args.new_tokens, rounds)
        ok &= r["ratio"] >= 0.9
        print(f"| {name} | {r['vocab']} | {r['threads']} | {r['free']:.1f} | {r['bound']:.1f} | {r['ratio']:.2f} ({r['ratio_min']:.2f}) "
              f"| {r['plain_ratio']:.2f} | {r['mask_ms']:.3f} | {r['masked_pct']:.0f}% | {r['forced']} | "
              f"{r['tokens']} |")
    print("\n" + ("constrained decode >= 90% of free decode" if ok else "BELOW TARGET: constrained < 90% of free"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
