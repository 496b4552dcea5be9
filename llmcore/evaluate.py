"""``llmcore eval``: the quality cost of an export, as perplexity on a text.

Perplexity is measured twice on the same tokens: with the exported program, run by the
ExecuTorch runtime, and with the eager fp32 model it came from, rebuilt from the export's
report (family, checkpoint or config, seed, transforms). The difference is what
quantization and lowering cost.

Programs return the logits of their last position only, so each scored token takes one
call through the KV cache; the tokens before the first scored one of a window or chunk
(its context) go in one prefill call, from position 0 (the cache is overwritten from there;
attention reads only positions up to the current one). Two protocols choose which tokens
are scored:

- ``sliding`` (the default, :func:`score`): windows overlap by half, and every token after
  the first is scored once.
- ``llama-perplexity`` (:func:`score_llama_perplexity`): llama.cpp's ``llama-perplexity``,
  non-overlapping chunks scored on their second half, so the figures compare 1:1 with it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from functools import partial
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
        # positions begin..first-1 only give context: one prefill call ending at the first
        # position whose logits score a token not scored yet
        first = max(scored_until - begin, 0)
        logits = logits_fn(ids[begin:begin + first + 1], 0).float()
        for pos in range(first, end - begin - 1):
            if pos > first:
                logits = logits_fn([ids[begin + pos]], pos).float()
            nll -= float(torch.log_softmax(logits, dim=-1)[ids[begin + pos + 1]])
            count += 1
        scored_until = end - 1
        begin += stride
    return Perplexity(math.exp(nll / count), count, round(time.perf_counter() - start_time, 2))


def score_llama_perplexity(
    logits_fn: Callable[[list[int], int], torch.Tensor], ids: list[int], ctx: int, bos_id: Optional[int]
) -> Perplexity:
    """Perplexity of ``ids`` as llama.cpp's ``llama-perplexity`` computes it (its function
    ``perplexity`` in tools/perplexity/perplexity.cpp), so the two figures compare 1:1.

    ``ids`` is the whole text, BOS first when the model adds one. It is cut into
    ``len(ids) // ctx`` chunks of ``ctx`` tokens, the remainder dropped. Each chunk is run
    from position 0 with its first token replaced by ``bos_id`` (when the model uses BOS),
    and only its second half is scored: the logits at position j score token j + 1, for j
    from ctx // 2 to ctx - 2. Every scored token so sees at least ctx / 2 tokens of context.
    (llama.cpp itself refuses texts shorter than two chunks; one chunk is scored here.)
    """
    if ctx < 3:
        raise LlmcoreError(f"--ctx {ctx} is too small: a chunk scores the tokens of its second half.",
                           stage="eval", fix="pass --ctx 3 or more (llama.cpp's default is 512).")
    n_chunks = len(ids) // ctx
    if n_chunks == 0:
        raise LlmcoreError(f"the text has {len(ids)} tokens, fewer than one chunk of --ctx {ctx}.", stage="eval",
                           fix="pass a longer --text, a smaller --ctx, or a larger --max-tokens.")
    start_time = time.perf_counter()
    first = ctx // 2
    nll, count = 0.0, 0
    for start in range(0, n_chunks * ctx, ctx):
        chunk = ids[start:start + ctx]
        if bos_id is not None:
            chunk[0] = bos_id
        logits = logits_fn(chunk[:first + 1], 0)  # the unscored first half: one prefill call
        for pos in range(first, ctx - 1):  # the last position predicts nothing inside the chunk
            if pos > first:
                logits = logits_fn([chunk[pos]], pos)
            nll -= float(torch.log_softmax(logits.float(), dim=-1)[chunk[pos + 1]])
            count += 1
    return Perplexity(math.exp(nll / count), count, round(time.perf_counter() - start_time, 2))


def eager_reference(report: dict):
    """The fp32 eager model of an export, rebuilt from its report, with a KV cache."""
    from llmcore.pipeline.load import load_model
    from llmcore.pipeline.transform import apply_transforms
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions
    from llmcore.records import TransformContext
    from llmcore.runtime import feed_in_chunks

    saved = report["options"]
    options = ExportOptions(**{k: v for k, v in saved.items() if k in ExportOptions.__dataclass_fields__})
    registry = load_registry()
    loaded = load_model(options, registry)
    context = TransformContext(loaded.metadata, report["model"]["max_seq_len"], options.model, tuple(options.plugins))
    # The plain-PyTorch cache: numerically the model itself, and fast in eager mode
    # (the custom ops' eager kernels are slow and log on every call).
    apply_transforms(loaded, [registry.get("transforms", "kv-cache-static", stage="eval")], context)
    module = loaded.module.eval()

    def call(tokens: list[int], pos: int) -> torch.Tensor:
        with torch.no_grad():
            out = module(torch.tensor([tokens]), torch.tensor([pos]))
        return out.reshape(-1, out.shape[-1])[-1]

    def logits(tokens: list[int], pos: int) -> torch.Tensor:  # as the program takes them (ring buffers)
        return feed_in_chunks(call, tokens, pos, context.max_tokens_per_call or len(tokens))

    return logits


PROTOCOLS = ("sliding", "llama-perplexity")


def evaluate(pte: str, text_path: str, max_tokens: Optional[int], window: Optional[int], with_eager: bool = True,
             protocol: str = "sliding", ctx: Optional[int] = None) -> dict:
    """Score the program, and its eager model unless ``with_eager`` is false, with one protocol.

    ``max_tokens`` caps the text's tokens (default: 1024 for ``sliding``; the whole text for
    ``llama-perplexity``, as llama.cpp reads it). ``window`` is ``sliding``'s window,
    ``ctx`` the chunk size of ``llama-perplexity`` (default 512, llama.cpp's)."""
    from llmcore.generate import TextTokenizer, tokenizer_beside
    from llmcore.runtime import Program

    if protocol == "sliding" and ctx is not None:
        raise LlmcoreError("--ctx is the chunk size of --protocol llama-perplexity; sliding takes --window.",
                           stage="eval", fix="pass --window N, or --protocol llama-perplexity --ctx N.")
    if protocol == "llama-perplexity" and window is not None:
        raise LlmcoreError("--window is the sliding protocol's; llama-perplexity takes --ctx.",
                           stage="eval", fix="pass --ctx N instead of --window N.")
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
    if max_tokens is None and protocol == "sliding":
        max_tokens = 1024
    ids = tokenizer.encode(text)[:max_tokens]
    uses_bos = bool(program.n_bos) and program.bos_id >= 0
    if uses_bos:
        ids = [program.bos_id] * program.n_bos + ids
    result: dict = {"pte": pte, "text": text_path, "protocol": protocol}
    if protocol == "sliding":
        window = min(window or program.max_context_len, program.max_context_len)
        result["window"] = window
        scorer = partial(score, ids=ids, window=window)
    else:
        ctx = 512 if ctx is None else ctx
        if ctx > program.max_context_len:
            raise LlmcoreError(
                f"--ctx {ctx} is longer than the program's context ({program.max_context_len} positions).",
                stage="eval",
                fix=f"pass --ctx {program.max_context_len} or less, or export with --max-seq-len {ctx} or more.",
            )
        result.update(ctx=ctx, chunks=len(ids) // ctx)
        bos_id = program.bos_id if uses_bos else None
        scorer = partial(score_llama_perplexity, ids=ids, ctx=ctx, bos_id=bos_id)
    result["program"] = asdict(scorer(program.logits))
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
        result["eager"] = asdict(scorer(eager_reference(report)))
        result["delta"] = result["program"]["perplexity"] - result["eager"]["perplexity"]
        result["delta_pct"] = 100 * result["delta"] / result["eager"]["perplexity"]
    return result


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="perplexity of a .pte and of its eager model on a text")
    p.add_argument("pte")
    p.add_argument("--text", required=True, help="a UTF-8 text file")
    p.add_argument("--protocol", choices=PROTOCOLS, default="sliding",
                   help="sliding: half-overlapping windows, every token scored (default); "
                        "llama-perplexity: llama.cpp's llama-perplexity, to compare with its figures")
    p.add_argument("--max-tokens", type=int,
                   help="read at most this many tokens of the text (default: 1024 for sliding, "
                        "the whole text for llama-perplexity)")
    p.add_argument("--window", type=int, help="sliding's context window (default: the program's)")
    p.add_argument("--ctx", type=int, help="llama-perplexity's chunk size, its -c (default: 512)")
    p.add_argument("--no-eager", action="store_true", help="score the program only")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
    result = evaluate(args.pte, args.text, args.max_tokens, args.window, with_eager=not args.no_eager,
                      protocol=args.protocol, ctx=args.ctx)
    if args.json:
        print(json.dumps(result))
        return 0
    if result["protocol"] == "sliding":
        print(f"protocol sliding, window {result['window']}")
    else:
        chunks = result["chunks"]
        print(f"protocol llama-perplexity, ctx {result['ctx']} ({chunks} chunk{'s' * (chunks != 1)})")
    prog = result["program"]
    print(f"program  perplexity {prog['perplexity']:.3f}  ({prog['tokens_scored']} tokens, {prog['seconds']}s)")
    if "eager" in result:
        eager = result["eager"]
        print(f"eager    perplexity {eager['perplexity']:.3f}  ({eager['tokens_scored']} tokens, {eager['seconds']}s)")
        print(f"delta    {result['delta']:+.3f} ({result['delta_pct']:+.2f}%)")
    return 0
