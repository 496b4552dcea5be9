"""The core's own commands: ``llmcore export``, ``plugins`` and ``run``.

Registered through the ``llmcore_commands`` hook like any plugin's command (the
applications' come from :mod:`llmcore.apps`); :mod:`llmcore.cli` builds the parser from
them. What each does is in the pipeline and the runtime: here are its arguments and the
few lines that call them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from llmcore import nesting
from llmcore.errors import LlmcoreError, require_extra
from llmcore.hookspecs import hookimpl
from llmcore.records import Command
from llmcore.runtime.chat_template import add_template_option


@hookimpl
def llmcore_commands() -> list[Command]:
    return [
        Command("export", help="export a model to a .pte program", add_arguments=export_arguments, run=cmd_export,
                eager=True),
        Command("plugins", help="list installed plugins and what they provide", add_arguments=plugins_arguments,
                run=cmd_plugins),
        Command("run", help="generate text with a .pte program", add_arguments=run_arguments, run=cmd_run,
                runs_program=True),
    ]


# ---- llmcore export -------------------------------------------------------------------------


def export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model family (see `llmcore plugins`)")
    p.add_argument("--config", help="named config for random initialisation")
    p.add_argument("--checkpoint", help="checkpoint file or folder")
    p.add_argument("--tokenizer", help="tokenizer files, when the checkpoint has none")
    p.add_argument("--plugins", help="backends in partitioning order, e.g. gpu_backend,cpu_backend; left out: "
                   "for a checkpoint or a --quantize recipe, the installed backends that put themselves in the CPU's "
                   "default list (the export names them), else the portable runtime; 'none': the portable runtime "
                   "only")
    p.add_argument("--quantize", help="quantizer recipe, e.g. int8-dynamic")
    p.add_argument("--quantize-option", action="append", metavar="KEY=VALUE", help="recipe option (repeatable)")
    p.add_argument("--backend-option", action="append", metavar="BACKEND.KEY=VALUE", help="partitioner option")
    p.add_argument("--transforms", help="extra source transforms by name, comma-separated")
    p.add_argument("--skip-transforms", help="automatic source transforms not to apply, e.g. kv-cache")
    p.add_argument("--max-seq-len", type=int, help="longest sequence the program accepts")
    p.add_argument("--kv-cache-dtype", help="what the KV cache keeps: fp32 (default), bf16, fp16 or int8 "
                   "(a half or a quarter of fp32's memory, and of what a decode step's attention reads)")
    p.add_argument("--recipe", help="YAML file with the same keys as these flags")
    p.add_argument("--prompt", help="example prompt for calibration and the parity check")
    p.add_argument("--strict-parity", type=float, metavar="TOL", help="fail if max |logit diff| > TOL")
    p.add_argument("--etrecord", help="write an ETRecord to this path")
    p.add_argument("--print-graph", action="store_true", help="print the delegated graph")
    p.add_argument(
        "--whole-graph-lowering",
        action="store_true",
        help="run to_edge on the whole graph, not on two of the model's identical blocks (slower; the same program)",
    )
    p.add_argument("--seed", type=int, help="seed for random init and calibration")
    add_template_option(p, "the chat template to record in tokenizer_config.json, in place of the checkpoint's")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("-o", "--output", help="the .pte to write")


def _key_values(pairs: Sequence[str], flag: str) -> dict[str, Any]:
    """``k=v`` pairs; values are read as YAML scalars (``32`` -> int, ``true`` -> bool)."""
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise LlmcoreError(
                f"{flag} expects KEY=VALUE, got {pair!r}.", stage="cli", fix=f"write e.g. {flag} group_size=32."
            )
        try:
            out[key.strip()] = nesting.yaml_loads(raw, what=f"{flag} {key.strip()}", stage="cli",
                                                  fix=f"write e.g. {flag} group_size=32.")
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out


def _backend_options(pairs: Sequence[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, value in _key_values(pairs, "--backend-option").items():
        backend, dot, option = key.partition(".")
        if not dot or not option:
            raise LlmcoreError(
                f"--backend-option expects BACKEND.KEY=VALUE, got {key!r}.",
                stage="cli",
                fix="write e.g. --backend-option mybackend.some_option=true.",
            )
        out.setdefault(backend, {})[option] = value
    return out


def _split(value: Optional[str]) -> Optional[list[str]]:
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def cmd_export(args: argparse.Namespace) -> int:
    from llmcore.api import export
    from llmcore.pipeline.report import format_delegation, format_summary
    from llmcore.recipe import build_options, load_recipe

    recipe = load_recipe(args.recipe) if args.recipe else {}
    flags = {
        "model": args.model,
        "output": args.output,
        "config": args.config,
        "checkpoint": args.checkpoint,
        "tokenizer": args.tokenizer,
        "plugins": _split(args.plugins),
        "quantize": args.quantize,
        "quantize_options": _key_values(args.quantize_option, "--quantize-option") or None,
        "backend_options": _backend_options(args.backend_option) or None,
        "transforms": _split(args.transforms),
        "skip_transforms": _split(args.skip_transforms),
        "max_seq_len": args.max_seq_len,
        "kv_cache_dtype": args.kv_cache_dtype,
        "prompt": args.prompt,
        "strict_parity": args.strict_parity,
        "etrecord": args.etrecord,
        "print_graph": args.print_graph or None,
        "whole_graph_lowering": args.whole_graph_lowering or None,
        "seed": args.seed,
        "chat_template": args.chat_template,
        "quiet": args.quiet or None,
    }
    options = build_options(recipe, flags)
    result = export(options)
    print(format_delegation(result.report["delegation"]))
    print()
    print(format_summary(result.report))
    print(f"report: {result.report_path}")
    return 0


# ---- llmcore plugins ------------------------------------------------------------------------


def plugins_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true")


def cmd_plugins(args: argparse.Namespace) -> int:
    from llmcore.plugins import KINDS, load_registry

    registry = load_registry()
    if args.json:
        data = {
            "plugins": [
                {
                    "name": p.name,
                    "distribution": p.distribution,
                    "version": p.version,
                    "entry_point": p.entry_point,
                    "hooks": sorted(set(p.hooks)),
                    "provides": p.provides,
                }
                for p in registry.plugins
            ],
            "failed": [{"name": f.name, "entry_point": f.entry_point, "error": f.error} for f in registry.failures],
            "conflicts": [
                {"kind": c.kind, "name": c.name, "plugins": [p.package for p in c.plugins]}
                for c in registry.conflicts
            ],
        }
        print(json.dumps(data, indent=2))
        return 0
    if not registry.plugins and not registry.failures:
        print("no llmcore plugins are installed (entry-point group 'llmcore').")
    for p in registry.plugins:
        print(f"{p.name}  ({p.package}; entry point {p.entry_point})")
        print(f"  hooks: {', '.join(sorted(set(p.hooks))) or '-'}")
        for kind, names in p.provides.items():
            print(f"  {KINDS[kind][3]}: {', '.join(names)}")
    for f in registry.failures:
        print(f"FAILED {f.name}  ({f.entry_point}): {f.error}")
    for c in registry.conflicts:
        print(c.error().one_line())
    return 0


# ---- llmcore run ----------------------------------------------------------------------------


def run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pte")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    add_template_option(p, "with --chat (which it implies), the chat template in place of the program's")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the one next to the .pte)")
    p.add_argument("--json", action="store_true", help="print ids, text and stats as one JSON object")
    p.add_argument("--json-schema", metavar="FILE",
                   help="constrain the reply to this JSON schema: it always parses and matches it")
    p.add_argument("--quiet", action="store_true")


def _json_schema_constraint(path: str, program, tokenizer):
    """``--json-schema FILE``: the reply constrained to the schema (llmcore.runtime.constrain)."""
    require_extra("llmcore run --json-schema", "constrain", ("llguidance",), stage="run")
    from llmcore.runtime.constrain import Constraint, GrammarError, json_schema_grammar

    try:
        schema = nesting.loads(Path(path).read_text(), what=f"--json-schema {path}", stage="cli",
                               fix="pass a file holding one JSON schema object.")
    except (OSError, ValueError) as exc:
        raise LlmcoreError(f"--json-schema {path}: cannot read a JSON schema from it ({exc}).", stage="cli",
                           fix="pass a file holding one JSON schema object.") from None
    if not isinstance(schema, dict):
        raise LlmcoreError(f"--json-schema {path}: the schema must be a JSON object.", stage="cli",
                           fix="pass a file holding one JSON schema object.")
    vocab = int(program.metadata.get("get_vocab_size") or tokenizer.vocab_size)
    try:
        return Constraint(json_schema_grammar(schema), tokenizer.json_text, program.eos_ids, vocab)
    except GrammarError as exc:
        raise LlmcoreError(f"--json-schema {path}: the grammar engine cannot compile it: {exc}", stage="cli",
                           fix="simplify the schema (llguidance supports most of JSON Schema draft 2020-12).") from None


def cmd_run(args: argparse.Namespace) -> int:
    from llmcore.api import load
    from llmcore.runtime import runtime_threads
    from llmcore.runtime.generate import Sampling

    if args.max_new_tokens < 1:
        raise LlmcoreError("--max-new-tokens must be at least 1.", stage="cli", fix="pass a positive --max-new-tokens.")
    Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)  # refused before loading
    model = load(args.pte, tokenizer=args.tokenizer)
    ids = model.prompt_ids(args.prompt, chat=args.chat, chat_template=args.chat_template)
    constraint = _json_schema_constraint(args.json_schema, model.program, model.tokenizer) if args.json_schema else None
    program = model.program
    if not program.use_kv_cache and len(ids) > program.max_seq_len and not args.json:
        print(
            f"[llmcore] note: the prompt has {len(ids)} tokens; the program sees the last {program.max_seq_len}.",
            file=sys.stderr,
        )
    on_text = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    result = model.generate(ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, constraint=constraint, on_text=on_text)
    if args.json:
        print(
            json.dumps(
                {
                    "prompt_ids": result.prompt_ids,
                    "generated_ids": result.generated_ids,
                    "text": result.text,
                    "stats": vars(result.stats),
                    "runtime_threads": runtime_threads(),
                }
            )
        )
    else:
        print()
        print(result.stats.line(), file=sys.stderr if args.quiet else sys.stdout)
    return 0
