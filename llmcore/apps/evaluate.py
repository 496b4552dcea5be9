"""``llmcore eval``: the quality cost of an export, as perplexity on a text.

Perplexity is measured twice on the same tokens: with the exported program, run by the
ExecuTorch runtime, and with the eager fp32 model it came from, rebuilt from the export's
report (family, checkpoint or config, seed, transforms). The difference is what
quantization and lowering cost; with the eager model, both run in lockstep and the KL
divergence of their next-token distributions is reported too (:class:`Divergence`).

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
import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from llmcore import nesting
from llmcore.errors import LlmcoreError, read_text_file


@dataclass
class Perplexity:
    perplexity: float
    tokens_scored: int
    seconds: float


def sliding_positions(logits_fn: Callable[[list[int], int], Any], ids: list[int], window: int) -> Iterator:
    """``(logits, target)`` for every token of ``ids`` after the first, in half-overlapping
    windows of ``window`` (``logits_fn(tokens, pos)``: a KV-cache call, whatever it returns)."""
    if len(ids) < 2:
        raise LlmcoreError("the text is too short to score (fewer than 2 tokens).", stage="eval",
                           fix="pass a longer --text.")
    stride = max(1, window // 2)
    begin, scored_until = 0, 0  # scored_until: the first target index not yet scored
    while scored_until < len(ids) - 1:
        end = min(begin + window, len(ids))
        # positions begin..first-1 only give context: one prefill call ending at the first
        # position whose logits score a token not scored yet
        first = max(scored_until - begin, 0)
        logits = logits_fn(ids[begin:begin + first + 1], 0)
        for pos in range(first, end - begin - 1):
            if pos > first:
                logits = logits_fn([ids[begin + pos]], pos)
            yield logits, ids[begin + pos + 1]
        scored_until = end - 1
        begin += stride


def score(logits_fn: Callable[[list[int], int], torch.Tensor], ids: list[int], window: int) -> Perplexity:
    """Perplexity of ``ids`` under ``logits_fn(tokens, pos)`` (a KV-cache call), sliding windows."""
    return perplexity(sliding_positions(logits_fn, ids, window))


def perplexity(positions: Iterable) -> Perplexity:
    """Perplexity over ``(logits, target)`` pairs."""
    start_time = time.perf_counter()
    nll, count = 0.0, 0
    for logits, target in positions:
        nll -= float(torch.log_softmax(logits.float(), dim=-1)[target])
        count += 1
    return Perplexity(math.exp(nll / count), count, round(time.perf_counter() - start_time, 2))


def llama_perplexity_positions(
    logits_fn: Callable[[list[int], int], Any], ids: list[int], ctx: int, bos_id: Optional[int]
) -> Iterator:
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
    first = ctx // 2
    for start in range(0, n_chunks * ctx, ctx):
        chunk = ids[start:start + ctx]
        if bos_id is not None:
            chunk[0] = bos_id
        logits = logits_fn(chunk[:first + 1], 0)  # the unscored first half: one prefill call
        for pos in range(first, ctx - 1):  # the last position predicts nothing inside the chunk
            if pos > first:
                logits = logits_fn([chunk[pos]], pos)
            yield logits, chunk[pos + 1]


def score_llama_perplexity(
    logits_fn: Callable[[list[int], int], torch.Tensor], ids: list[int], ctx: int, bos_id: Optional[int]
) -> Perplexity:
    """Perplexity by :func:`llama_perplexity_positions` (llama.cpp's protocol)."""
    return perplexity(llama_perplexity_positions(logits_fn, ids, ctx, bos_id))


@dataclass
class Divergence:
    """How far the program's next-token distributions are from the eager model's, over the
    scored positions: mean KL(eager || program) in nats (llama.cpp's "Mean KLD"), its 99th
    percentile, and how often the two pick the same top token. Unlike a perplexity
    difference, which on a few hundred tokens moves with the rounding noise of the program
    alone (docs/quantization.md, "Side by side with llama.cpp, one run"), the mean KL is the
    steadier measure of what quantization costs.

    Each mean comes with its standard error (the positions' spread over the square root of
    their number): ``mean_kl_stderr``, and ``log_ratio_stderr`` of the mean of the program's
    negative log-likelihood minus the eager model's a position (the log of the perplexities'
    ratio). A program a change far below its rounding moved scores differently by about that
    much, because which way its activations round moves with it (docs/quantization.md, "How
    finely these figures tell programs apart"): two programs whose figures are within two
    standard errors are not told apart by this text."""

    mean_kl: float
    p99_kl: float
    top1_agreement: float
    mean_kl_stderr: float
    log_ratio_stderr: float


def standard_error(values: list[float]) -> float:
    """The standard error of the mean of ``values``: their sample standard deviation over the
    square root of their number (0 for fewer than two)."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def compare(positions: Callable[[Callable], Iterator], program_fn: Callable, eager_fn: Callable):
    """Program and eager model through the same protocol in lockstep (``positions(logits_fn)``
    yields ``(logits, target)``): their perplexities and the :class:`Divergence`."""
    seconds = {"program": 0.0, "eager": 0.0}

    def both(tokens: list[int], pos: int):
        t0 = time.perf_counter()
        program = program_fn(tokens, pos)
        t1 = time.perf_counter()
        eager = eager_fn(tokens, pos)
        seconds["program"] += t1 - t0
        seconds["eager"] += time.perf_counter() - t1
        return program, eager

    nll = {"program": 0.0, "eager": 0.0}
    kls, log_ratios, same = [], [], 0
    for (program, eager), target in positions(both):
        lp = torch.log_softmax(program.float(), dim=-1)
        le = torch.log_softmax(eager.float(), dim=-1)
        nll["program"] -= float(lp[target])
        nll["eager"] -= float(le[target])
        log_ratios.append(float(le[target]) - float(lp[target]))
        kls.append(float((le.exp() * (le - lp)).sum()))
        same += int(lp.argmax()) == int(le.argmax())
    n = len(kls)
    scored = {k: Perplexity(math.exp(nll[k] / n), n, round(seconds[k], 2)) for k in nll}
    ordered = sorted(kls)
    divergence = Divergence(sum(kls) / n, ordered[min(n - 1, int(0.99 * n))], same / n,
                            standard_error(kls), standard_error(log_ratios))
    return scored["program"], scored["eager"], divergence


def eager_reference(report: dict):
    """The fp32 eager model of an export, rebuilt from its report, with a KV cache."""
    from llmcore.pipeline.load import load_model
    from llmcore.pipeline.plan import resolve_plan
    from llmcore.pipeline.transform import apply_transforms
    from llmcore.plugins import load_registry
    from llmcore.recipe import ExportOptions
    from llmcore.records import TransformContext
    from llmcore.runtime import feed_in_chunks

    saved = report["options"]
    options = ExportOptions(**{k: v for k, v in saved.items() if k in ExportOptions.__dataclass_fields__})
    registry = load_registry()
    loaded = load_model(resolve_plan(options, registry), floats=True)  # the fp32 model
    context = TransformContext(loaded.metadata, report["model"]["max_seq_len"], options.model, tuple(options.plugins))
    # The plain-PyTorch cache: numerically the model itself, and fast in eager mode
    # (the custom ops' eager kernels are slow and log on every call).
    _, convention = apply_transforms(loaded, [registry.get("transforms", "kv-cache-static", stage="eval")], context)
    module = loaded.module.eval()

    def call(tokens: list[int], pos: int) -> torch.Tensor:
        with torch.no_grad():
            out = module(torch.tensor([tokens]), torch.tensor([pos]))
        return out.reshape(-1, out.shape[-1])[-1]

    def logits(tokens: list[int], pos: int) -> torch.Tensor:  # as the program takes them (ring buffers)
        return feed_in_chunks(call, tokens, pos, convention.max_tokens_per_call or len(tokens))

    return logits


def available_memory() -> Optional[int]:
    """Bytes the kernel says a new allocation can have without swapping (MemAvailable), or
    None where /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory_for_eager(report: dict) -> None:
    """Refuse, before loading it, an eager reference this machine cannot hold: it is the fp32
    model (4 bytes a parameter: Llama-3.1-8B's is 30 GiB), and a process that runs out of
    memory is killed without a word. The report says how many parameters the model has
    (exports from before it said so are not checked)."""
    parameters = report.get("model", {}).get("parameters")
    available = available_memory()
    if not parameters or available is None:
        return
    needed = 4 * parameters
    if needed > 0.9 * available:
        raise LlmcoreError(
            f"the eager reference is the fp32 model, {needed / 2**30:.1f} GiB for {parameters / 1e9:.2f}B parameters, "
            f"and this machine has {available / 2**30:.1f} GiB available.",
            stage="eval",
            fix="pass --no-eager to score the program alone, or evaluate on a machine with more memory.",
        )


PROTOCOLS = ("sliding", "llama-perplexity")


def evaluate(pte: str, text_path: str, max_tokens: Optional[int], window: Optional[int], with_eager: bool = True,
             protocol: str = "sliding", ctx: Optional[int] = None) -> dict:
    """Score the program, and its eager model unless ``with_eager`` is false, with one protocol.

    ``max_tokens`` caps the text's tokens (default: 1024 for ``sliding``; the whole text for
    ``llama-perplexity``, as llama.cpp reads it). ``window`` is ``sliding``'s window,
    ``ctx`` the chunk size of ``llama-perplexity`` (default 512, llama.cpp's)."""
    from llmcore.runtime.generate import TextTokenizer, tokenizer_beside
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
    text = read_text_file(text_path, "text", "eval", "pass --text with a UTF-8 text file.")
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
        positions = partial(sliding_positions, ids=ids, window=window)
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
        positions = partial(llama_perplexity_positions, ids=ids, ctx=ctx, bos_id=bos_id)
    if not with_eager:
        result["program"] = asdict(perplexity(positions(program.logits)))
    else:
        report_path = Path(pte).with_name(Path(pte).stem + ".report.json")
        try:
            report = nesting.loads(report_path.read_text(), what=f"the report {str(report_path)!r}", stage="eval",
                                   fix="keep the report llmcore export wrote next to the .pte, or pass --no-eager.")
        except (OSError, ValueError):
            raise LlmcoreError(
                f"the eager reference is rebuilt from {report_path.name}, which is missing or unreadable.",
                stage="eval",
                fix="keep the report llmcore export wrote next to the .pte, or pass --no-eager.",
            ) from None
        check_memory_for_eager(report)
        scored, eager, divergence = compare(positions, program.logits, eager_reference(report))
        result.update(program=asdict(scored), eager=asdict(eager), divergence=asdict(divergence))
        result["delta"] = result["program"]["perplexity"] - result["eager"]["perplexity"]
        result["delta_pct"] = 100 * result["delta"] / result["eager"]["perplexity"]
        # the ratio's standard error, from its log's (d exp(u) = exp(u) du)
        ratio = result["program"]["perplexity"] / result["eager"]["perplexity"]
        result["delta_pct_stderr"] = 100 * ratio * divergence.log_ratio_stderr
    return result


def add_arguments(p) -> None:
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
        print(f"delta    {result['delta']:+.3f} ({result['delta_pct']:+.2f}% +- {result['delta_pct_stderr']:.2f}%)")
        div = result["divergence"]
        print(f"KL(eager || program) mean {div['mean_kl']:.5f} +- {div['mean_kl_stderr']:.5f}, "
              f"p99 {div['p99_kl']:.4f}; same top token {100 * div['top1_agreement']:.1f}%")
        print("(+- one standard error: programs within two of each other are not told apart by this text)")
    return 0
