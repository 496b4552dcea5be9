"""Constrained decoding: a grammar decides which tokens may come next.

A JSON schema (``response_format``, ``llmcore run --json-schema``) or a tool's parameters
become a grammar; at every sampling step the grammar engine gives the set of tokens that
keep the output inside it, and the others' logits are set to -inf before sampling. The
answer then parses and matches the schema whatever the model's size: a random model
under a schema still writes valid JSON.

The engine is llguidance (PyPI ``llguidance``): a self-contained wheel with no Python
dependencies, which compiles JSON schemas and Lark grammars against the tokenizer lazily
and then computes a token mask in a small part of a decode step (docs/performance.md,
"Measurements behind the code"; ``benchmarks/bench_constrained.py`` measures it inside
generation). xgrammar, the other
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
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np
import torch

from llmcore import nesting
from llmcore.errors import LlmcoreError

TOOL_TAG_OPEN, TOOL_TAG_CLOSE = "<tool_call>", "</tool_call>"


class GrammarError(ValueError):
    """The grammar engine refused a schema or grammar; the message says why."""


@lru_cache(maxsize=8)
def _grammar_tokenizer(tokenizer_json: str, eos_ids: tuple, n_vocab: int):
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=list(eos_ids) or None)


@lru_cache(maxsize=16)
def _prototype(grammar: str, tokenizer_json: str, eos_ids: tuple, n_vocab: int):
    """A matcher of ``grammar`` that each generation copies. llguidance builds its lexer
    lazily, state by state, as generation reaches them; copies share what any of them has
    built, so the second request with a schema does not pay for it again (over the first
    hundred tokens of a JSON object, as much as the decode time of a tiny model;
    docs/performance.md, "Measurements behind the code")."""
    import llguidance

    matcher = llguidance.LLMatcher(_grammar_tokenizer(tokenizer_json, eos_ids, n_vocab), grammar)
    if matcher.is_error():
        raise GrammarError(matcher.get_error())
    return matcher


class Constraint:
    """One generation's grammar state: :meth:`sample` the next token (which the grammar
    then consumes), or :meth:`filter` logits and :meth:`consume` a token yourself.

    A full token mask costs from microseconds to a millisecond or more (a 49k vocabulary
    inside a JSON string), which is as long as a small model's whole forward pass. Most
    tokens a model picks are allowed anyway, so :meth:`sample` first draws from the
    unmasked logits and asks the grammar about that one token; only when the grammar
    refuses it is the mask computed and the token drawn again from the masked logits, as
    llama.cpp's sampler does. For greedy decoding and plain temperature sampling the
    result is exactly mask-then-sample: an allowed argmax is the masked argmax, and a draw
    kept only when allowed, else redrawn from the masked distribution, has the masked
    distribution. top-k and top-p cut the distribution before the grammar does, so with
    them the mask comes first. Where the mask allows a single token (the punctuation of a
    JSON object), that token is the answer without sampling.

    Where the grammar allows only one continuation for several tokens (a schema's keys,
    ``{"name": "`` of a tool call), :meth:`forced` hands them over at once and the loops
    feed them to the program in one call with the sampled token ("fast-forward"): one
    forward pass instead of one per token, and no mask. ``fast_forward=False`` turns it off
    (the benchmark measures both)."""

    def __init__(self, grammar: str, tokenizer_json: str, eos_ids: Sequence[int], n_vocab: int,
                 fast_forward: bool = True):
        self._matcher = _prototype(grammar, tokenizer_json, tuple(eos_ids), n_vocab).deep_copy()
        self._mask = torch.zeros((1, (n_vocab + 31) // 32), dtype=torch.int32)
        self._mask_bytes = self._mask.numpy().view(np.uint8)  # the same memory, as bytes
        # (what llguidance.torch.fill_next_token_bitmask does, without its per-call checks)
        self._mask_at = (self._mask.data_ptr(), self._mask.numel() * self._mask.element_size())
        self.n_vocab = n_vocab
        self.mask_seconds = 0.0  # time spent on the grammar per token, for the benchmark
        self.masks = 0  # tokens that needed the full mask
        self.tokens = 0  # tokens sampled
        self.fast_forward = fast_forward
        self.forced_tokens = 0  # tokens taken from the grammar without a forward pass of their own

    def sample(self, logits: torch.Tensor, sampling) -> int:
        """The next token, consumed by the grammar: ``sampling``
        (:class:`llmcore.runtime.generate.Sampling`) of the logits with every token the grammar
        forbids here removed."""
        self.tokens += 1
        if sampling.temperature == 0 or (sampling.top_k == 0 and sampling.top_p >= 1.0):
            token = sampling(logits)
            start = time.perf_counter()
            taken = token < self.n_vocab and self._matcher.try_consume_tokens([token]) == 1
            self.mask_seconds += time.perf_counter() - start
            if taken:
                return token
        start = time.perf_counter()
        self._compute_mask()
        allowed = int.from_bytes(self._mask_bytes, "little")
        if allowed and not allowed & (allowed - 1):  # one token allowed (JSON's punctuation): no need to sample
            token = allowed.bit_length() - 1
        else:
            token = sampling(self._apply_mask(logits))
        self.consume(token)
        self.mask_seconds += time.perf_counter() - start
        return token

    def forced(self) -> list[int]:
        """The tokens the grammar allows no alternative to from here, already consumed; empty
        without ``fast_forward`` or once the grammar has ended. llguidance stops short of a
        token a longer one could still replace, so these are the tokens the model would be
        made to write one by one."""
        if not self.fast_forward:
            return []
        start = time.perf_counter()
        tokens = []
        # the forced bytes cost a small part of the forced tokens (docs/performance.md,
        # "Measurements behind the code") and are mostly none: ask for tokens only when there
        # are some
        if not self._matcher.is_stopped() and self._matcher.compute_ff_bytes():
            tokens = self._matcher.compute_ff_tokens()
        if tokens and not self._matcher.consume_tokens(tokens):
            raise GrammarError(self._matcher.get_error() or f"the grammar refused its own forced tokens {tokens}")
        self.mask_seconds += time.perf_counter() - start
        self.forced_tokens += len(tokens)
        return tokens

    def filter(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with every token the grammar forbids at this point set to -inf."""
        start = time.perf_counter()
        self._compute_mask()
        out = self._apply_mask(logits)
        self.mask_seconds += time.perf_counter() - start
        return out

    def _compute_mask(self) -> None:
        self._matcher.unsafe_compute_mask_ptr(*self._mask_at)
        self.masks += 1

    def _apply_mask(self, logits: torch.Tensor) -> torch.Tensor:
        forbidden = np.unpackbits(self._mask_bytes, bitorder="little", count=self.n_vocab) == 0
        return torch.as_tensor(logits).float().reshape(-1)[: self.n_vocab].masked_fill(
            torch.from_numpy(forbidden), float("-inf"))

    def consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(self._matcher.get_error() or f"token {token} was not allowed by the grammar")

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
        call = nesting.loads(body, what="the model's tool call", stage="serve")
    except (ValueError, LlmcoreError):  # not JSON, or nested past the limit: a reply, not a call
        return None
    if isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict):
        return call
    return None
