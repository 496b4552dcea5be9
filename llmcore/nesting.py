"""JSON and YAML from users, read with a limit on how deeply they nest.

Every document llmcore parses from outside (an HTTP request body and its tool-call
arguments, a recipe or matrix file, a checkpoint's config.json or params.json, tokenizer
files, a ``--json-schema`` file, a model's tool call) is read here. Python's parsers
recurse once per level: a body of 100,000 ``[`` (200 KB) ended as a RecursionError
wherever it surfaced, a plain-text HTTP 500 or an "internal error" exit. Here it is one
:class:`~llmcore.errors.LlmcoreError` that names what was being read.

The limit is :data:`MAX_DEPTH` arrays and objects inside one another, the same as the C++
runner's reader (``runtime/src/json.h``), so both runners refuse the same files. No file a
model ships comes near it: a tokenizer.json nests 4 deep, a config.json 3.

Not read here: a tokenizer.json handed to the ``tokenizers`` library (Rust's serde_json stops
at 128 levels with an error, which llmcore.runtime.generate.TextTokenizer reports), and a GGUF, none
of whose strings is JSON (its chat template is Jinja, compiled by llmcore.runtime.chat_template; its nested
arrays are walked under their own limit by the llama plugin's formats.py).
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any, Optional

from llmcore.errors import LlmcoreError

MAX_DEPTH = 512

_ESCAPE = re.compile(r"\\.", re.S)  # \" and \\ inside a string: no quote, no backslash
_STRING = re.compile(r'"[^"]*"')  # once the escapes are gone
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_FIX = "a model's files nest a few levels deep: get this one again from where the model came from."


def deeper_than(text: str, limit: int = MAX_DEPTH) -> bool:
    """Whether more than ``limit`` arrays and objects of the JSON ``text`` lie inside one another.

    Linear, and in C but for one step per bracket: regex passes cut out the escapes, then the
    strings (a ``[`` inside a string, a token of a vocabulary, is no nesting), then all but
    the brackets, which are summed as a running depth. (One pattern for a string with its
    escapes would start again at every quote of an unterminated ``"\\"\\"\\"...``: quadratic.)
    A text with no more than ``limit`` opening brackets is let through at the speed of
    ``str.count``. Text that is not JSON gets an answer all the same; the parser then says
    what is wrong with it."""
    if text.count("[") + text.count("{") <= limit:
        return False
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", _ESCAPE.sub("", text)))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > limit


def too_deep(what: str, *, stage: str, plugin: Optional[str] = None, fix: Optional[str] = None,
             how: str = f"arrays or objects more than {MAX_DEPTH} deep") -> LlmcoreError:
    """The one error for a document nested past the limit: ``what`` names it (``config.json
    '/models/x/config.json'``, ``the request body``)."""
    return LlmcoreError(f"{what} nests {how}.", stage=stage, plugin=plugin, fix=fix or _FIX)


def loads(text: str | bytes, *, what: str, stage: str = "load", plugin: Optional[str] = None,
          fix: Optional[str] = None) -> Any:
    """``json.loads(text)`` for a document nested at most :data:`MAX_DEPTH` deep; deeper is
    :func:`too_deep`'s error. Malformed JSON raises ``json.JSONDecodeError`` (a ValueError)
    as ``json.loads`` does, so that each caller keeps its own words for it.

    The depth is measured before parsing (:func:`deeper_than`) rather than left to ``json.loads``'
    RecursionError: that comes at a depth that depends on how deep the caller's stack
    already is (about 1,000 levels less the frames above), it is no ValueError, so the
    handlers written for malformed JSON let it through as a crash, and it cannot say what was
    being read. Measured, the limit is one number wherever the call is made, the C++ reader's
    too. The scan is a pass over the whole text, comparable to the parse itself on a large
    tokenizer.json (docs/performance.md, "Measurements behind the code"), and next to
    nothing on a file with at most 512 brackets."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode(json.detect_encoding(text), "surrogatepass")  # as json.loads reads bytes
    if deeper_than(text):
        raise too_deep(what, stage=stage, plugin=plugin, fix=fix)
    try:
        return json.loads(text)
    except RecursionError:  # within the limit, yet a caller's stack was already deep
        raise too_deep(what, stage=stage, plugin=plugin, fix=fix) from None


def yaml_loads(text: str, *, what: str, stage: str, fix: Optional[str] = None) -> Any:
    """``yaml.safe_load(text)``, a document nested past what the parser can follow being
    :func:`too_deep`'s error; YAML errors pass as ``yaml.YAMLError``.

    YAML is not measured first: a ``[`` may stand unquoted in a plain scalar, so counting
    brackets would refuse good files. PyYAML's parser is Python code, so its RecursionError
    (at about 490 levels, block or flow) is raised cleanly and caught here."""
    import yaml

    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise too_deep(what, stage=stage, fix=fix, how="lists or mappings deeper than its parser can follow") from None
