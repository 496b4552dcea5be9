"""Constrained decoding: a grammar decides which tokens may come next.

A JSON schema (``response_format``, ``llmcore run --json-schema``) or a tool's parameters
become a grammar; at every sampling step the grammar engine gives the set of tokens that
keep the output inside it, and the others' logits are set to -inf before sampling. The
answer then parses and matches the schema whatever the model's size: a random model
under a schema still writes valid JSON.

The engine is llguidance (PyPI ``llguidance``): a self-contained wheel with no Python
dependencies, which compiles JSON schemas and Lark grammars against the tokenizer lazily
(a new schema costs about a millisecond before its first token) and then computes a token
mask in 0.01-0.12 ms for GPT-2's 50k vocabulary (measured here;
``benchmarks/bench_constrained.py`` measures it inside generation). xgrammar, the other
well-kept engine, requires torch, transformers and triton at run time (its 0.2.8 wheel's
metadata), too much for the core of a tool that runs programs without torch's training stack. What is here: building grammars
for the OpenAI request shapes, and applying the mask.

Tool calls come in the format the model's chat template teaches: ``<tool_call>{json}
</tool_call>`` (Hermes, SmolLM2, Qwen2.5) when the template mentions that tag, else a bare
JSON object (Llama 3.x). The JSON is ``{"name": ..., "arguments": {...}}`` with the
arguments constrained to the chosen tool's ``parameters`` schema.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np
import torch

TOOL_TAG_OPEN, TOOL_TAG_CLOSE = "<tool_call>", "</tool_call>"


class GrammarError(ValueError):
    """The grammar engine refused a schema or grammar; the message says why."""


@lru_cache(maxsize=8)
def _grammar_tokenizer(tokenizer_json: str, eos_ids: tuple, n_vocab: int):
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=list(eos_ids) or None)


_mask_worker: Optional[ThreadPoolExecutor] = None
_mask_worker_lock = threading.Lock()


def _worker() -> ThreadPoolExecutor:
    """The thread that computes masks while the program runs its forward pass."""
    global _mask_worker
    with _mask_worker_lock:
        if _mask_worker is None:
            _mask_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmcore-mask")
        return _mask_worker


class Constraint:
    """One generation's grammar state: :meth:`filter` the logits, :meth:`consume` the token.

    The mask for the next token depends only on the tokens consumed so far, so it is
    computed on a worker thread as soon as the previous token is consumed (and when the
    constraint is made), while the program runs the forward pass that produces the logits
    it will filter: both release the GIL, so on a small model, whose forward pass takes
    about as long as the mask, the mask costs little more than the wait for it."""

    def __init__(self, grammar: str, tokenizer_json: str, eos_ids: Sequence[int], n_vocab: int):
        import llguidance

        self._tokenizer = _grammar_tokenizer(tokenizer_json, tuple(eos_ids), n_vocab)
        self._matcher = llguidance.LLMatcher(self._tokenizer, grammar)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        self._mask = torch.zeros((1, (n_vocab + 31) // 32), dtype=torch.int32)
        self._mask_bytes = self._mask.numpy().view(np.uint8)  # the same memory, as bytes
        # (what llguidance.torch.fill_next_token_bitmask does, without its per-call checks)
        self._mask_at = (self._mask.data_ptr(), self._mask.numel() * self._mask.element_size())
        self.n_vocab = n_vocab
        self.mask_seconds = 0.0  # time spent computing and applying masks, for the benchmark
        self.wait_seconds = 0.0  # of which generation waited for (the rest overlapped a forward pass)
        self._next: Optional[Future] = None
        self._start_mask()

    def _compute_mask(self) -> float:
        start = time.perf_counter()
        self._matcher.unsafe_compute_mask_ptr(*self._mask_at)
        return time.perf_counter() - start

    def _start_mask(self) -> None:
        self._next = _worker().submit(self._compute_mask)

    def filter(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with every token the grammar forbids at this point set to -inf."""
        start = time.perf_counter()
        computed = self._next.result() if self._next is not None else self._compute_mask()
        self._next = None
        applying = time.perf_counter()
        forbidden = np.unpackbits(self._mask_bytes, bitorder="little", count=self.n_vocab) == 0
        out = logits.float().reshape(-1)[: self.n_vocab].masked_fill(torch.from_numpy(forbidden), float("-inf"))
        end = time.perf_counter()
        self.mask_seconds += computed + (end - applying)
        self.wait_seconds += end - start
        return out

    def consume(self, token: int) -> None:
        if self._next is not None:  # consumed without filtering: the pending mask is stale
            self._next.result()
            self._next = None
        if not self._matcher.consume_token(token):
            raise GrammarError(self._matcher.get_error() or f"token {token} was not allowed by the grammar")
        if not self._matcher.is_stopped():
            self._start_mask()

    def finished(self) -> bool:
        """The grammar accepts no more tokens (other than EOS)."""
        return self._matcher.is_stopped()


def check_grammar(grammar: str) -> None:
    """Refuse a grammar the engine cannot compile, before any generation."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(messages[0] if messages else "invalid grammar")


# Compact JSON (no optional whitespace): what small models write best, and the fewest tokens.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: dict) -> str:
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=COMPACT)
    except Exception as exc:  # llguidance raises ValueError (or its own errors) for schemas it refuses
        raise GrammarError(str(exc)) from None
    check_grammar(grammar)
    return grammar


def json_object_grammar() -> str:
    return json_schema_grammar({"type": "object"})


# ---- tool calls ---------------------------------------------------------------------------------


@dataclass
class Tool:
    name: str
    parameters: dict


def _strict(parameters: dict) -> dict:
    """A tool's parameters as OpenAI's strict mode reads them: an object schema that does not
    say otherwise takes no properties beyond those it lists (else the grammar lets the model
    invent keys and fill them until the token budget runs out)."""
    if parameters.get("type") == "object" and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


def _call_schema(tools: list[Tool]) -> dict:
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": _strict(t.parameters)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tool_call_grammar(tools: list[Tool], tagged: bool, optional: bool) -> str:
    """A Lark grammar for one tool call among ``tools`` in the template's format; with
    ``optional`` (tool_choice "auto") a plain-text reply is allowed too, as long as it does
    not start like a call (``<`` when tagged, ``{`` when bare)."""
    import llguidance

    call = f"%json {json.dumps({**_call_schema(tools), 'x-guidance': COMPACT})}"
    body = f'"{TOOL_TAG_OPEN}\\n" call "\\n{TOOL_TAG_CLOSE}"' if tagged else "call"
    lines = [f"call: {call}"]
    if optional:
        first = "<" if tagged else "{"
        lines.insert(0, f"start: tool | TEXT\ntool: {body}\nTEXT: /[^{first}\\s](.|\\n)*/")
    else:
        lines.insert(0, f"start: {body}")
    grammar = llguidance.LLMatcher.grammar_from_lark("\n".join(lines))
    check_grammar(grammar)
    return grammar


def parse_tool_call(text: str, tagged: bool) -> Optional[dict]:
    """``{"name": ..., "arguments": {...}}`` when ``text`` is one tool call in the format, else None."""
    body = text.strip()
    if tagged:
        if not (body.startswith(TOOL_TAG_OPEN) and body.endswith(TOOL_TAG_CLOSE)):
            return None
        body = body[len(TOOL_TAG_OPEN): -len(TOOL_TAG_CLOSE)]
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict):
        return call
    return None
