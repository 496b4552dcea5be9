"""Export options, and recipe files that hold them.

A recipe is a YAML mapping with the same keys as ``llmcore export``'s flags (``max-seq-len``
or ``max_seq_len``); flags given on the command line override it. Unknown keys and values
of the wrong type are errors that name the key and what it accepts.
"""

from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, get_args, get_origin, get_type_hints

from llmcore import nesting
from llmcore.errors import LlmcoreError

DEFAULT_PROMPT = "Once upon a time, there was a little robot who"


@dataclass
class ExportOptions:
    """Everything one export needs; one field per ``llmcore export`` flag."""

    model: str = ""
    """Model family name (``--model``)."""
    output: str = ""
    """Where to write the ``.pte`` (``-o``)."""
    config: Optional[str] = None
    """Named configuration for random initialisation (``--config``)."""
    checkpoint: Optional[str] = None
    """Checkpoint file or folder (``--checkpoint``)."""
    tokenizer: Optional[str] = None
    """Tokenizer files, when the checkpoint does not carry them (``--tokenizer``)."""
    plugins: list[str] = field(default_factory=list)
    """Backends in the order their partitioners see the graph (``--plugins a,b``). Empty: the
    CPU's default list for a checkpoint or a recipe (:func:`llmcore.pipeline.plan.choose_backends`),
    else the portable runtime; ``["none"]``: the portable runtime."""
    quantize: Optional[str] = None
    """Quantizer recipe name (``--quantize``)."""
    quantize_options: dict[str, Any] = field(default_factory=dict)
    """Options for the quantizer recipe, e.g. ``{group_size: 32}``."""
    backend_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-backend partitioner options: ``{backend_name: {option: value}}``."""
    transforms: list[str] = field(default_factory=list)
    """Extra source transforms by name, on top of the automatic ones."""
    skip_transforms: list[str] = field(default_factory=list)
    """Automatic source transforms not to apply (``--skip-transforms kv-cache``)."""
    max_seq_len: Optional[int] = None
    """Longest sequence the program accepts; the model's own limit by default."""
    kv_cache_dtype: str = "fp32"
    """What the KV cache keeps (``--kv-cache-dtype``): ``fp32``, ``bf16``, ``fp16`` or ``int8``
    (:data:`llmcore.kv_cache.CACHE_DTYPES`)."""
    prompt: str = DEFAULT_PROMPT
    """Example prompt for calibration and the parity check."""
    strict_parity: Optional[float] = None
    """Fail the export when the max absolute logit difference exceeds this."""
    etrecord: Optional[str] = None
    """Write an ETRecord here (``--etrecord``)."""
    print_graph: bool = False
    """Print the delegated graph (``--print-graph``)."""
    whole_graph_lowering: bool = False
    """Run ``to_edge`` on the whole graph even when the model is N identical blocks
    (``--whole-graph-lowering``; slower, the same program: for checking)."""
    seed: int = 0
    """Seed for random initialisation and calibration."""
    chat_template: Optional[str] = None
    """A chat template to record in ``tokenizer_config.json`` in place of the checkpoint's:
    a built-in's name or a Jinja file (``--chat-template``, llmcore.runtime.chat_template)."""
    quiet: bool = False
    """No progress on stderr."""


FIELDS = {f.name: f for f in dataclasses.fields(ExportOptions)}
_HINTS = get_type_hints(ExportOptions)
# torch seeds are 64-bit: signed or unsigned
SEED_RANGE = (-(2**63), 2**64 - 1)

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80
_repr.maxlist = _repr.maxdict = _repr.maxtuple = _repr.maxset = 6
_repr.maxlevel = 3


def short_repr(value: Any) -> str:
    """``repr`` cut short: a recipe value can be huge (a YAML alias bomb), a message must not."""
    return _repr.repr(value)


def _type_name(hint: Any) -> str:
    origin = get_origin(hint)
    if origin is list:
        return "a list"
    if origin is dict:
        return "a mapping of option names to values"
    args = [a for a in get_args(hint) if a is not type(None)]
    if args:
        return _type_name(args[0])
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        hint, str(hint)
    )


def _coerce(key: str, value: Any) -> Any:
    """Check one recipe value against the field's type; ints are accepted for floats."""
    hint = _HINTS[key]
    args = get_args(hint)
    if type(None) in args:  # Optional[X]
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    want = get_origin(hint) or hint
    if want is list and isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, want) and not (want in (int, float) and isinstance(value, bool))
    if want is list and ok:
        ok = all(isinstance(v, str) for v in value)
    if want is dict and ok:
        ok = all(isinstance(k, str) for k in value)
    if key == "backend_options" and ok:
        bad = [k for k, v in value.items() if not isinstance(v, dict) or not all(isinstance(o, str) for o in v)]
        if bad:
            raise LlmcoreError(
                f"recipe key 'backend_options' must map each backend to a mapping of its options, "
                f"got {short_repr(value[bad[0]])} for {short_repr(bad[0])}.",
                stage="recipe",
                fix="write e.g. `backend_options: {mybackend: {some_option: true}}`.",
            )
    if not ok:
        raise LlmcoreError(
            f"recipe key {key!r} must be {_type_name(hint)}, got {type(value).__name__} {short_repr(value)}.",
            stage="recipe",
            fix=f"set {key!r} to {_type_name(hint)}.",
        )
    return value


def parse_recipe(data: Any, source: str = "recipe") -> dict[str, Any]:
    """Validate a recipe mapping and return it with normalised keys."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise LlmcoreError(
            f"{source} must be a YAML mapping of option names to values, got {type(data).__name__}.",
            stage="recipe",
            fix="write one `key: value` per line, e.g. `quantize: int8-dynamic`.",
        )
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in FIELDS or key == "quiet":
            allowed = ", ".join(k.replace("_", "-") for k in FIELDS if k != "quiet")
            raise LlmcoreError(
                f"unknown key {short_repr(raw_key)} in {source}.",
                stage="recipe",
                fix=f"use one of: {allowed}.",
            )
        out[key] = _coerce(key, value)
    return out


def load_recipe(path: str | Path) -> dict[str, Any]:
    """Read and validate a YAML recipe file."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LlmcoreError(
            f"cannot read recipe {str(path)!r}: {exc.strerror or exc}.",
            stage="recipe",
            fix="check the path given to --recipe.",
        ) from None
    except UnicodeDecodeError as exc:
        raise LlmcoreError(
            f"recipe {str(path)!r} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start:exc.start + 1]!r}).",
            stage="recipe",
            fix="pass a YAML text file to --recipe, saved as UTF-8.",
        ) from None
    try:
        data = nesting.yaml_loads(text, what=f"recipe {str(path)!r}", stage="recipe",
                                  fix="write one `key: value` per line, e.g. `quantize: int8-dynamic`.")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise LlmcoreError(
            f"recipe {str(path)!r} is not valid YAML{where}: {problem}.",
            stage="recipe",
            fix="fix the YAML syntax (indentation, colons, quotes).",
        ) from None
    return parse_recipe(data, source=f"recipe {str(path)!r}")


def build_options(recipe: dict[str, Any], flags: dict[str, Any]) -> ExportOptions:
    """Merge a recipe with command-line flags (flags win) into :class:`ExportOptions`."""
    merged = dict(recipe)
    for key, value in flags.items():
        if value is not None:
            merged[key] = value
    options = ExportOptions(**merged)
    # --model may be left out with a checkpoint: the family is then read from it (load stage)
    needed = ("output",) if options.checkpoint else ("model", "output")
    missing = [name for name in needed if not getattr(options, name)]
    if missing:
        flag = {"model": "--model", "output": "-o/--output"}
        raise LlmcoreError(
            f"no {' or '.join(missing)} given.",
            stage="recipe",
            fix=" and ".join(f"pass {flag[m]} (or set {m!r} in the recipe)" for m in missing) + ".",
        )
    if not SEED_RANGE[0] <= options.seed <= SEED_RANGE[1]:
        raise LlmcoreError(
            f"seed {options.seed} does not fit in 64 bits.",
            stage="recipe",
            fix="pass a --seed between 0 and 2**64 - 1.",
        )
    if options.max_seq_len is not None and options.max_seq_len < 2:
        raise LlmcoreError(
            f"max-seq-len must be at least 2, got {options.max_seq_len}.",
            stage="recipe",
            fix="pass a larger --max-seq-len.",
        )
    return options


def meant_for(wanted, selected) -> bool:
    """Whether a record that lists the backends it is ``wanted`` for (a recipe, a source
    transform, a post-pass) is for an export of the ``selected`` ones: it names none (it is
    for any export), or one of them."""
    return not wanted or bool(set(wanted) & set(selected))


def check_plugin_options(what: str, schema: dict, given: dict, plugin: str) -> dict:
    """Fill defaults and check names and types of plugin options against a schema."""
    out = {key: default for key, (_, default, _) in schema.items()}
    for key, value in (given or {}).items():
        if key not in schema:
            allowed = ", ".join(f"{k} ({h})" for k, (_, _, h) in schema.items()) or "none"
            raise LlmcoreError(
                f"{what} has no option {key!r}.",
                stage="options",
                plugin=plugin,
                fix=f"its options are: {allowed}.",
            )
        typ = schema[key][0]
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise LlmcoreError(
                f"option {key!r} of {what} must be {typ.__name__}, got {short_repr(value)}.",
                stage="options",
                plugin=plugin,
                fix=f"set {key} to a {typ.__name__}: {schema[key][2]}.",
            )
        out[key] = value
    return out
