"""Text generation over a loaded program: tokenizer, sampler and the decode loop.

The loop follows the program's calling convention (``docs/pte-contract.md``): without a
KV cache it feeds the last ``max_seq_len`` tokens every step; with one it prefills the
prompt once and then feeds the tokens each step yields (one, or more when a grammar forces
some).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from llmcore.errors import LlmcoreError, read_text_file
from llmcore.progress import peak_rss_mib

TOKENIZER_FILE = "tokenizer.json"


def native_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an error of a native library rather than Ctrl-C or an exit: a Rust
    panic in `tokenizers` surfaces as ``pyo3_runtime.PanicException``, which derives from
    BaseException (not Exception) and cannot be imported by name."""
    return not isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError))


class TextTokenizer:
    """Encode/decode with a Hugging Face ``tokenizer.json`` (through the `tokenizers` package)."""

    def __init__(self, json_text: str, source: str = "<memory>"):
        from tokenizers import Tokenizer

        from llmcore.runtime.program import captured_stderr

        try:
            with captured_stderr():  # a Rust panic prints its backtrace on fd 2
                self._tok = Tokenizer.from_str(json_text)
        except BaseException as exc:
            if not native_error(exc):
                raise
            raise LlmcoreError(
                f"tokenizer {source!r} is not a valid tokenizer.json: {' '.join(str(exc).split())[:200]}",
                stage="tokenizer",
                fix="export the model again so llmcore writes its tokenizer, or pass a valid --tokenizer.",
            ) from None
        self.source = source
        self.json_text = json_text

    def _call(self, what: str, fn):
        """Run the native tokenizer: its errors (a Rust panic included) become one line."""
        try:
            return fn()
        except BaseException as exc:
            if not native_error(exc):
                raise
            raise LlmcoreError(
                f"tokenizer {self.source!r} failed to {what}: {' '.join(str(exc).split())[:200]}",
                stage="tokenizer",
                fix="export the model again so llmcore writes its tokenizer, or pass a valid --tokenizer.",
            ) from None

    @classmethod
    def from_file(cls, path: str | Path) -> "TextTokenizer":
        text = read_text_file(
            path, "tokenizer", "tokenizer",
            f"keep the {TOKENIZER_FILE} that llmcore export wrote next to the .pte, or pass --tokenizer.",
        )
        return cls(text, str(path))

    def encode(self, text: str) -> list[int]:
        return self._call("encode", lambda: self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._call("decode", lambda: self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def stream(self) -> Callable[[int], str]:
        """A decoder for a reply as it is generated: called with each new id, it returns the
        text that id completes, ``""`` while a character's bytes are still incomplete, special
        tokens skipped (``decode(ids, skip_special_tokens=True)`` joined up).

        It is `tokenizers`' ``DecodeStream``, which decodes only the last few ids each time.
        Decoding the whole reply again for every new token, as llmcore did before, grew with
        the reply, and cost several times more right after a forward call, whose weights
        have swept the core's caches (docs/performance.md, "Measurements behind the code")."""
        from tokenizers.decoders import DecodeStream

        state, tok = DecodeStream(skip_special_tokens=True), self._tok

        def text_of(token: int) -> str:
            return self._call("decode", lambda: state.step(tok, token)) or ""

        return text_of

    def token_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()


@dataclass
class Sampling:
    """temperature 0 means greedy (argmax); top-k 0 and top-p 1 mean no cut-off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    _gen: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise LlmcoreError(
                "sampling needs temperature >= 0, top-k >= 0 and 0 < top-p <= 1.",
                stage="run",
                fix="check --temperature, --top-k and --top-p.",
            )
        self._gen = torch.Generator()
        self._gen.manual_seed(self.seed if self.seed is not None else torch.seed())

    def __call__(self, logits: "torch.Tensor | np.ndarray") -> int:
        """The next token from ``logits`` (``[V]``): a tensor, or a numpy view of the
        program's output (:meth:`llmcore.runtime.Program.read_logits`), never written to."""
        if self.temperature == 0:
            # numpy's argmax (the first maximum, as torch's): a fraction of torch's time on a
            # 49k vocabulary, more so right after a forward call (docs/performance.md,
            # "Measurements behind the code")
            if isinstance(logits, np.ndarray):
                return int(logits.argmax())
            return int(logits.detach().float().reshape(-1).numpy().argmax())
        logits = torch.as_tensor(logits).float() / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1.0:
            probs = nucleus(probs, self.top_p)
        return draw(probs, self._gen)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """An id with probability ``probs[id] / probs.sum()``: one uniform number looked up in the
    cumulative sum. ``torch.multinomial`` over SmolLM2's 49152 probabilities was most of a
    sampled token's Python work; this takes a small part of it (docs/performance.md,
    "Measurements behind the code")."""
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.numel() - 1)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` with everything outside the nucleus zeroed: the most likely tokens, each
    kept while the mass of those before it is below ``top_p``. The nucleus lies among the
    best ``k`` for the first ``k`` (64, 512, ...) whose mass reaches ``top_p``, so only those
    are ranked, not all of SmolLM2's 49152 probabilities every token, whose sort slowed
    decode at ``--top-p 0.9`` far below greedy (docs/performance.md, "What was tried":
    sampling without sorting; ``runtime/src/sampler.cpp`` does the same)."""
    n = probs.numel()
    k = min(64, n)
    while True:
        best, order = torch.topk(probs, k)
        if k == n or float(best.sum()) >= top_p:
            break
        k = min(k * 8, n)
    keep = torch.cumsum(best, 0) - best < top_p
    return torch.zeros_like(probs).scatter_(0, order[keep], best[keep])


@dataclass
class GenerationStats:
    """A generation's figures. ``time_to_first_token_s`` runs from the start to the first
    token handed on (the prompt's calls, sampling, the caller's ``on_token``);
    ``prefill_tok_s`` counts the prompt's calls of the program alone, up to its logits, as
    ``llmcore_runner``'s ``prefill_tok_s`` does, so that the two compare (sampling the first
    token and writing its text are left out; docs/performance.md, "Measurements behind the
    code")."""

    prompt_tokens: int
    generated_tokens: int
    time_to_first_token_s: float
    prefill_tok_s: float
    decode_tok_s: float
    peak_rss_mib: float

    def line(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tok, generated {self.generated_tokens} tok | "
            f"time to first token {self.time_to_first_token_s * 1000:.1f} ms | "
            f"prefill {self.prefill_tok_s:.1f} tok/s | decode {self.decode_tok_s:.1f} tok/s | "
            f"peak RSS {self.peak_rss_mib:.0f} MiB"
        )


@dataclass
class Generation:
    prompt_ids: list[int]
    generated_ids: list[int]
    stats: GenerationStats


def next_tokens(logits: torch.Tensor, sampling: Sampling, constraint=None, room: int = 1) -> list[int]:
    """What one forward pass yields: the sampled token and, under a grammar, the tokens the
    grammar forces after it (:meth:`llmcore.runtime.constrain.Constraint.forced`), at most ``room``
    in all. The decode loops of ``generate`` and ``serve`` feed them to the program
    together in the next call."""
    if constraint is None:
        return [sampling(logits)]
    token = constraint.sample(logits, sampling)
    return [token, *constraint.forced()][: max(1, room)]


def reader(program) -> Callable:
    """``read_logits(tokens, input_pos, read)`` of ``program``: its own where it has one
    (:meth:`llmcore.runtime.Program.read_logits`, no copy of the logits), else ``read`` of
    its ``logits`` (stand-ins such as eager PyTorch in benchmarks)."""
    own = getattr(program, "read_logits", None)
    if own is not None:
        return own
    return lambda tokens, input_pos, read: read(program.logits(tokens, input_pos))


def generate(
    program,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: Sampling,
    on_token: Optional[Callable[[int], None]] = None,
    stop_at_eos: bool = True,
    constraint=None,
) -> Generation:
    """Generate up to ``max_new_tokens`` after the prompt; stops at an EOS id unless told
    not to (benchmarks decode a fixed number of tokens). With ``constraint``
    (:class:`llmcore.runtime.constrain.Constraint`) only tokens its grammar allows are sampled, the
    tokens it forces are fed without a forward pass each (its opening ones with the
    prompt), and generation ends where the grammar does."""
    from llmcore.runtime.program import torch_on_one_thread

    with torch_on_one_thread():  # the loop's own tensor ops (sampling) stay off the pool's cores
        return _generate(program, prompt_ids, max_new_tokens, sampling, on_token, stop_at_eos, constraint)


def _generate(program, prompt_ids, max_new_tokens, sampling, on_token, stop_at_eos, constraint) -> Generation:
    if not prompt_ids:
        raise LlmcoreError("the prompt is empty after tokenization.", stage="run", fix="pass a non-empty --prompt.")
    limit = program.max_context_len if program.use_kv_cache else None
    if program.use_kv_cache and len(prompt_ids) > limit:  # longer than one call: fed in chunks
        raise LlmcoreError(
            f"the prompt has {len(prompt_ids)} tokens; this program takes at most "
            f"{limit} in its context.",
            stage="run",
            fix="shorten the prompt, or export with a larger --max-seq-len.",
        )
    eos = set(program.eos_ids)
    tokens = list(prompt_ids)
    generated: list[int] = []

    def room() -> int:  # tokens that may still be generated (and, with a cache, fed)
        return min(max_new_tokens - len(generated), limit - len(tokens) if limit else max_new_tokens)

    def accept(new: list[int]) -> None:
        for token in new:
            generated.append(token)
            tokens.append(token)
            if on_token is not None:
                on_token(token)

    start = time.perf_counter()
    first_token_at, first_tokens = start, 0
    fed = 0  # tokens the KV cache holds
    if constraint is not None and max_new_tokens > 0:
        accept(constraint.forced()[: room()])  # the grammar's opening goes in with the prompt
    read_logits = reader(program)
    prompt_done_at = None  # when the prompt's logits were ready

    def choose(logits) -> list[int]:  # sampled where the program left the logits, before its next call
        nonlocal prompt_done_at
        if prompt_done_at is None:
            prompt_done_at = time.perf_counter()
        return next_tokens(logits, sampling, constraint, room())

    while len(generated) < max_new_tokens:
        if program.use_kv_cache:
            if fed and len(tokens) >= limit:
                break
            new = read_logits(tokens[fed:], fed, choose)
            fed = len(tokens)
        else:
            new = read_logits(tokens[-program.max_seq_len :], None, choose)
        accept(new)
        if not first_tokens:  # decode is timed from here; forced opening tokens count as prompt time
            first_token_at, first_tokens = time.perf_counter(), len(generated)
        if new[0] in eos and (stop_at_eos or constraint is not None):  # a grammar ends at EOS too
            break
        if constraint is not None and constraint.finished():
            break
    end = time.perf_counter()
    prefill_s = max(first_token_at - start, 1e-9)
    decode_steps = len(generated) - first_tokens
    stats = GenerationStats(
        prompt_tokens=len(prompt_ids),
        generated_tokens=len(generated),
        time_to_first_token_s=prefill_s,
        prefill_tok_s=len(prompt_ids) / max((prompt_done_at or first_token_at) - start, 1e-9),
        decode_tok_s=decode_steps / (end - first_token_at) if decode_steps > 0 else 0.0,
        peak_rss_mib=peak_rss_mib(),
    )
    return Generation(list(prompt_ids), generated, stats)


class TextStream:
    """Writes each token's text as soon as it is whole (:meth:`TextTokenizer.stream`)."""

    def __init__(self, tokenizer: TextTokenizer, write: Callable[[str], None]):
        self._text_of = tokenizer.stream()
        self.write = write

    def __call__(self, token: int) -> None:
        piece = self._text_of(token)
        if piece:
            self.write(piece)


def tokenizer_beside(pte_path: str | Path) -> Path:
    return Path(pte_path).resolve().parent / TOKENIZER_FILE


def check_tokenizer_fits(program, tokenizer: TextTokenizer) -> None:
    """A tokenizer.json left by another export in the same folder would feed the program
    ids it has no embedding for; say so instead of failing inside the runtime."""
    vocab = program.metadata.get("get_vocab_size")
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise LlmcoreError(
            f"tokenizer {tokenizer.source!r} has {tokenizer.vocab_size} tokens but the program's "
            f"vocabulary has {vocab}: it belongs to another model.",
            stage="run",
            fix="export each model into its own folder (llmcore writes tokenizer.json next to the .pte), "
            "or pass --tokenizer.",
        )


def prompt_ids_for(program, tokenizer: TextTokenizer, prompt: str) -> list[int]:
    check_tokenizer_fits(program, tokenizer)
    ids = tokenizer.encode(prompt)
    if program.n_bos and program.bos_id >= 0:
        ids = [program.bos_id] * program.n_bos + ids
    return ids

