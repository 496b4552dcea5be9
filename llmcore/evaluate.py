"""``llmcore eval``: the quality cost of an export, as perplexity on a text.

Perplexity is measured twice on the same tokens: with the exported program, run by the
ExecuTorch runtime, and with the eager fp32 model it came from, rebuilt from the export's
report (family, checkpoint or config, seed, transforms). The difference is what
quantization and lowering cost.

Programs return the logits of their last position only, so scoring goes one token at a
time through the KV cache: a window of the model's context is fed from position 0, and
each step's logits score the next token. Windows overlap by half; only the tokens past the
overlap are scored, so every token after the first window sees half a window of context.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from llmcore.errors import LlmcoreError


@dataclass
class Perplexity:
    perplexity: float
    tokens_scored: int
    seconds: float


def score(logits_fn: Callable[[list[int], int], torch.Tensor], ids: list[int], window: int) -> Perplexity:
    """Perplexity of ``ids`` under ``logits_fn(tokens, pos)`` (a KV-cache call)."""
    if len(ids) < 2:
        raise LlmcoreError("the text is too short to score (fewer than 2 tokens).", stage="eval",
                           fix="pass a longer --text.")
    start_time = time.perf_counter()
    stride = max(1, window // 2)
    nll, count = 0.0, 0
    begin, scored_until = 0, 0  # scored_until: the first target index not yet scored
    while scored_until < len(ids) - 1:
        end = min(begin + window, len(ids))
        for pos in range(end - begin - 1):
            logits = logits_fn([ids[begin + pos]], pos).float()
            target_index = begin + pos + 1
            if target_index <= scored_until:
                continue
            nll -= float(torch.log_softmax(logits, dim=-1)[ids[target_index]])
            count += 1
        scored_until = end - 1
        begin += stride
    return Perplexity(math.exp(nll / count), count, round(time.perf_counter() - start_time, 2))


def eager_reference(report: dict):
    """The fp32 eager model of an export, rebuilt from its report, with a KV cache."""
    from llmcore.pipeline.load import load_model
    from llmcore.pipeline.transform import apply_transforms
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions
    from llmcore.records import TransformContext

    saved = report["options"]
    options = ExportOptions(**{k: v for k, v in saved.items() if k in ExportOptions.__dataclass_fields__})
    registry = load_registry()
    loaded = load_model(options, registry)
    context = TransformContext(loaded.metadata, report["model"]["max_seq_len"], options.model, tuple(options.plugins))
    # The plain-PyTorch cache: numerically the model itself, and fast in eager mode
    # (the custom ops' eager kernels are slow and log on every call).
    apply_transforms(loaded, [registry.get("transforms", "kv-cache-static", stage="eval")], context)
    module = loaded.module.eval()

    def logits(tokens: list[int], pos: int) -> torch.Tensor:
        with torch.no_grad():
            out = module(torch.tensor([tokens]), torch.tensor([pos]))
        return out.reshape(-1, out.shape[-1])[-1]

    return logits


def evaluate(pte: str, text_path: str, max_tokens: int, window: Optional[int], with_eager: bool = True) -> dict:
    from llmcore.generate import TextTokenizer, tokenizer_beside
    from llmcore.runtime import Program

    program = Program.load(pte)
    if not program.use_kv_cache:
        raise LlmcoreError(
            "llmcore eval scores programs with a KV cache; this one has none.",
            stage="eval",
            fix="export without --skip-transforms kv-cache to evaluate it.",
        )
    try:
        text = Path(text_path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LlmcoreError(f"cannot read text {text_path!r}: {exc}", stage="eval",
                           fix="pass --text with a UTF-8 text file.") from None
    tokenizer = TextTokenizer.from_file(tokenizer_beside(pte))
    ids = tokenizer.encode(text)[:max_tokens]
    if program.n_bos and program.bos_id >= 0:
        ids = [program.bos_id] * program.n_bos + ids
    window = min(window or program.max_context_len, program.max_context_len)
    result = {"pte": pte, "text": text_path, "window": window,
              "program": asdict(score(program.logits, ids, window))}
    if with_eager:
        report_path = Path(pte).with_name(Path(pte).stem + ".report.json")
        try:
            report = json.loads(report_path.read_text())
        except (OSError, ValueError):
            raise LlmcoreError(
                f"the eager reference is rebuilt from {report_path.name}, which is missing or unreadable.",
                stage="eval",
                fix="keep the report llmcore export wrote next to the .pte, or pass --no-eager.",
            ) from None
        result["eager"] = asdict(score(eager_reference(report), ids, window))
        result["delta"] = result["program"]["perplexity"] - result["eager"]["perplexity"]
        result["delta_pct"] = 100 * result["delta"] / result["eager"]["perplexity"]
    return result


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="perplexity of a .pte and of its eager model on a text")
    p.add_argument("pte")
    p.add_argument("--text", required=True, help="a UTF-8 text file")
    p.add_argument("--max-tokens", type=int, default=1024, help="score at most this many tokens")
    p.add_argument("--window", type=int, help="context window (default: the program's)")
    p.add_argument("--no-eager", action="store_true", help="score the program only")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
    result = evaluate(args.pte, args.text, args.max_tokens, args.window, with_eager=not args.no_eager)
    if args.json:
        print(json.dumps(result))
        return 0
    prog = result["program"]
    print(f"program  perplexity {prog['perplexity']:.3f}  ({prog['tokens_scored']} tokens, {prog['seconds']}s)")
    if "eager" in result:
        eager = result["eager"]
        print(f"eager    perplexity {eager['perplexity']:.3f}  ({eager['tokens_scored']} tokens, {eager['seconds']}s)")
        print(f"delta    {result['delta']:+.3f} ({result['delta_pct']:+.2f}%)")
    return 0
