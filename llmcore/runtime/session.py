"""A loaded program and the tokens its KV cache holds: generation that reuses the cache.

``llmcore serve`` and ``llmcore chat`` run their requests here. An :class:`Engine` is one
loaded program; it remembers which tokens its cache holds. A request whose prompt starts
with them (the next turn of a conversation: the same messages plus the reply and a new one)
is prefilled from the first new token only, and its :class:`Outcome` says how many prompt
tokens came from the cache. A program with ring-buffer (sliding window) caches reuses its
cache only when the prompt extends the cached tokens exactly: positions it has written past
a shorter common prefix may have overwritten rows that prefix still needs.

:func:`run` generates for one :class:`Request`: text goes to a callback as it becomes final
(stop strings never reach it), and a ``threading.Event`` stops it at the next token. A
request with a ``grammar`` is decoded under it (:mod:`llmcore.runtime.constrain`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

from llmcore.errors import LlmcoreError


@dataclass
class Request:
    """What to generate, in tokens: the prompt, the length, sampling and stop strings."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: Optional[int]
    stop: list[str]
    grammar: Optional[str] = None  # llguidance grammar the reply must follow


class Engine:
    """One loaded program and the tokens its KV cache holds (positions 0..len-1)."""

    def __init__(self, pte: str, tokenizer_path: str, *, program=None, tokenizer=None):
        """``program`` and ``tokenizer``: the loaded ``pte`` and the tokenizer of
        ``tokenizer_path`` where the caller has them already (``llmcore.load``'s model)."""
        from llmcore.runtime.generate import TextTokenizer, check_tokenizer_fits
        from llmcore.runtime.program import Program

        self.program = program if program is not None else Program.load(pte)
        if not self.program.use_kv_cache:
            raise LlmcoreError("llmcore serve runs programs with a KV cache; this one has none.", stage="serve",
                               fix="export without --skip-transforms kv-cache.")
        self.tokenizer = tokenizer if tokenizer is not None else TextTokenizer.from_file(tokenizer_path)
        check_tokenizer_fits(self.program, self.tokenizer)
        self.cached: list[int] = []
        self.vocab = int(self.program.metadata.get("get_vocab_size") or self.tokenizer.vocab_size)
        # ring buffers: a call takes fewer tokens than the context holds
        self.ring = self.program.max_seq_len < self.program.max_context_len

    def reusable(self, ids: list[int]) -> int:
        """How many leading tokens of ``ids`` the cache already holds and may keep; at least
        one token is always fed, since the logits come from the last one fed."""
        common = 0
        for a, b in zip(self.cached, ids[:-1]):
            if a != b:
                break
            common += 1
        if self.ring and common < len(self.cached):
            return 0
        return common

    def prefill(self, ids: list[int]):
        """Logits after ``ids``, feeding only what the cache does not hold; and that count.
        The logits are lent, as :meth:`step`'s."""
        keep = self.reusable(ids)
        self.cached = []  # if the call fails, nothing is known to be in the cache
        logits = self.program.read_logits(ids[keep:], keep, _lent)
        self.cached = list(ids)
        return logits, keep

    def step(self, tokens: list[int]):
        """Logits after feeding ``tokens`` (one sampled token, and any a grammar forced after it).

        The row is lent: the program's own output (:meth:`llmcore.runtime.program.Program.read_logits`),
        which this engine's next call overwrites. A request samples from it before that call,
        and requests take an engine one at a time (serve's queue, chat's loop), so no copy is made,
        and the serving loop spends less time outside the program (docs/performance.md, "What
        was tried": the server lends the logits row too)."""
        logits = self.program.read_logits(tokens, len(self.cached), _lent)
        self.cached.extend(tokens)
        return logits


def _lent(row):
    """``read`` for :meth:`llmcore.runtime.program.Program.read_logits` that hands the row itself back."""
    return row


@dataclass
class Outcome:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of ``text`` could still become a stop string."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


def run(engine: Engine, req: Request, emit: Callable[[str], None], cancelled: threading.Event) -> Outcome:
    """Generate for ``req`` on ``engine`` (in a worker thread): text deltas go to ``emit``
    as they become final (stop strings never reach it), until EOS, a stop string,
    ``max_tokens``, the end of the context, or ``cancelled``. Under a grammar, the tokens
    it forces go to the program together (its opening ones with the prompt)."""
    from llmcore.runtime.program import torch_on_one_thread

    with torch_on_one_thread():  # the loop's own tensor ops (sampling) stay off the pool's cores
        return _run(engine, req, emit, cancelled)


def _run(engine: Engine, req: Request, emit: Callable[[str], None], cancelled: threading.Event) -> Outcome:
    from llmcore.runtime.generate import Sampling, next_tokens

    sampling = Sampling(temperature=req.temperature, top_p=req.top_p, seed=req.seed)
    eos = set(engine.program.eos_ids)
    context = engine.program.max_context_len
    constraint = None
    if req.grammar is not None:
        from llmcore.runtime.constrain import Constraint

        constraint = Constraint(req.grammar, engine.tokenizer.json_text, engine.program.eos_ids, engine.vocab)
    generated: list[int] = []
    text, sent = "", 0
    text_of = engine.tokenizer.stream()

    def first_stop(text: str) -> int:
        hits = [i for i in (text.find(s, max(0, sent - len(s))) for s in req.stop) if i >= 0]
        return min(hits) if hits else -1

    def room(fed: int) -> int:  # tokens that may still be generated; the cache keeps one slot free
        return min(req.max_tokens - len(generated), context - 1 - fed)

    def take(new: list[int]) -> Optional[str]:
        """Add ``new`` to the reply; "stop" when it ends the reply."""
        nonlocal text, sent
        for token in new:
            if token in eos:
                return "stop"
            generated.append(token)
            piece = text_of(token)
            if not piece:  # in the middle of a multi-byte character, or a special token
                continue
            text += piece
            cut = first_stop(text)
            if cut >= 0:
                text = text[:cut]
                return "stop"
            final = len(text) - _held_back(text, req.stop)
            if final > sent:
                emit(text[sent:final])
                sent = final
        return "stop" if constraint is not None and constraint.finished() else None

    opening = constraint.forced()[: max(0, room(len(req.prompt_ids)))] if constraint is not None else []
    logits, cached = engine.prefill(req.prompt_ids + opening)
    finish = take(opening)
    while finish is None:
        if cancelled.is_set():
            finish = "cancelled"
            break
        new = next_tokens(logits, sampling, constraint, room(len(engine.cached)))
        finish = take(new)
        if finish is None and (len(generated) >= req.max_tokens or len(engine.cached) + len(new) >= context):
            finish = "length"
        if finish is None:
            logits = engine.step(new)
    if finish != "stop" or not req.stop:  # the whole text: nothing more will complete a character
        text = engine.tokenizer.decode(generated, skip_special_tokens=True)
        cut = first_stop(text)
        if cut >= 0:
            text, finish = text[:cut], "stop"
    if len(text) > sent and finish != "cancelled":
        emit(text[sent:])
    return Outcome(text, "length" if finish == "cancelled" else finish, len(req.prompt_ids), len(generated),
                   min(cached, len(req.prompt_ids)))
