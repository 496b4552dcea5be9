"""The ``llmcore`` command: export, plugins, run, inspect, profile, eval, serve, chat, matrix.

Errors the user can act on are printed as one line (``llmcore: error: [stage/plugin] ...
Fix: ...``) with exit code 2; ``--debug`` adds the traceback. Unexpected exceptions exit
with code 1 and the same one-line treatment. Ctrl-C prints one line too, and the command
then ends killed by SIGINT (status 130 in a shell), as :func:`die_of_sigint` explains.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
from pathlib import Path
import traceback
import warnings
from typing import Any, Optional, Sequence

from llmcore import nesting
from llmcore.errors import LlmcoreError

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


def _quiet_libraries(debug: bool) -> None:
    """Keep torch/torchao/executorch chatter off the user's terminal unless --debug."""
    if debug:
        os.environ["LLMCORE_DEBUG"] = "1"
        return
    warnings.filterwarnings("ignore")
    # Warnings of llmcore and its plugins (modules named llmcore*: a recipe saying what it
    # rounded and at what cost) reach the terminal; other libraries' only from ERROR up.
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    if any(getattr(h, "llmcore", False) for h in root.handlers):
        return
    handler = logging.StreamHandler()
    handler.llmcore = True  # one per process, however often main() runs
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    handler.addFilter(lambda r: r.levelno >= logging.ERROR or r.name.startswith("llmcore"))
    root.addHandler(handler)
    for name in ("torchao", "executorch"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _quiet_torch(debug: bool) -> None:
    """torch installs its own log handlers; quiet them after import (export and run only)."""
    if debug:
        return
    import torch._logging

    torch._logging.set_logs(all=logging.ERROR)
    logging.getLogger("torch").setLevel(logging.ERROR)


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


# ---- commands ----------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    from llmcore.pipeline import export
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


def one_openmp_thread_per_worker() -> bool:
    """Before OpenMP starts: one OpenMP thread for every thread that asks, the runtime's
    pool workers included; returns whether it was set here. ``custom_sdpa`` calls BLAS from
    those workers, and with the default (one OpenMP thread per core) each worker starts a
    team of its own: on 2 cores, SmolLM2 8da4w decode at positions 64-192 ran at 76 tok/s
    instead of 150, and after an export's calibration every two-thread PyTorch op ran ~4x
    slower (``llmcore.runtime.torch_on_one_thread``). ``torch.set_num_threads`` sets it for
    the calling thread only (:func:`torch_on_every_core`). An explicit ``OMP_NUM_THREADS``,
    or a torch already imported, is left alone."""
    if "torch" in sys.modules or "OMP_NUM_THREADS" in os.environ:
        return False
    os.environ["OMP_NUM_THREADS"] = "1"
    return True


def torch_on_every_core() -> None:
    """After :func:`one_openmp_thread_per_worker`: PyTorch's own ops on the calling thread
    use one thread per available core again, as they would have without it (an export's
    calibration forward and quantizer searches)."""
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


# The commands that run programs: with PyTorch in the same process, their runtime workers'
# OpenMP is kept to one thread (one_openmp_thread_per_worker), and so is the main thread's
# unless the command runs an eager model of its own (EAGER_COMMANDS); see docs/performance.md,
# "The Python loop beside OpenMP's threads".
RUNTIME_COMMANDS = ("run", "chat", "serve", "eval", "profile")
EAGER_COMMANDS = ("export", "eval")  # the calibration forward and quantizer searches; eval's reference model


def set_up_threads(command: str) -> None:
    """Before torch is imported, the threads ``llmcore COMMAND`` runs with: the runtime
    workers' OpenMP kept to one thread for every command that runs a program, and the
    eager PyTorch work of ``export`` and ``eval`` on every core. ``benchmarks/bench_export.py``
    sets up its export processes with it too."""
    if command not in RUNTIME_COMMANDS + EAGER_COMMANDS:
        return
    limited = one_openmp_thread_per_worker()
    if limited and command in EAGER_COMMANDS:
        torch_on_every_core()


def _json_schema_constraint(path: str, program, tokenizer):
    """``--json-schema FILE``: the reply constrained to the schema (llmcore.constrain)."""
    from llmcore.constrain import Constraint, GrammarError, json_schema_grammar

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
    from llmcore import chat
    from llmcore.generate import Sampling, TextStream, TextTokenizer, generate, prompt_ids_for, tokenizer_beside
    from llmcore.runtime import Program, runtime_threads

    if args.max_new_tokens < 1:
        raise LlmcoreError("--max-new-tokens must be at least 1.", stage="cli", fix="pass a positive --max-new-tokens.")
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    tokenizer_path = args.tokenizer or tokenizer_beside(args.pte)
    program = Program.load(args.pte)
    tokenizer = TextTokenizer.from_file(tokenizer_path)
    prompt = args.prompt
    if args.chat or args.chat_template:
        prompt = chat.apply_template(tokenizer_path, prompt, args.chat_template)
    ids = prompt_ids_for(program, tokenizer, prompt)
    constraint = _json_schema_constraint(args.json_schema, program, tokenizer) if args.json_schema else None
    if not program.use_kv_cache and len(ids) > program.max_seq_len and not args.json:
        print(
            f"[llmcore] note: the prompt has {len(ids)} tokens; the program sees the last {program.max_seq_len}.",
            file=sys.stderr,
        )
    stream = None
    if not args.json:
        stream = TextStream(tokenizer, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    result = generate(program, ids, args.max_new_tokens, sampling, on_token=stream, constraint=constraint)
    if args.json:
        print(
            json.dumps(
                {
                    "prompt_ids": result.prompt_ids,
                    "generated_ids": result.generated_ids,
                    "text": tokenizer.decode(result.generated_ids, skip_special_tokens=True),
                    "stats": vars(result.stats),
                    "runtime_threads": runtime_threads(),
                }
            )
        )
    else:
        print()
        print(result.stats.line(), file=sys.stderr if args.quiet else sys.stdout)
    return 0


# ---- parser --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from llmcore import chat

    parser = argparse.ArgumentParser(prog="llmcore", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks and library logs")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="export a model to a .pte program")
    p.add_argument("--model", help="model family (see `llmcore plugins`)")
    p.add_argument("--config", help="named config for random initialisation")
    p.add_argument("--checkpoint", help="checkpoint file or folder")
    p.add_argument("--tokenizer", help="tokenizer files, when the checkpoint has none")
    p.add_argument("--plugins", help="backends in partitioning order, e.g. gpu_backend,cpu_backend (empty: portable runtime only)")
    p.add_argument("--quantize", help="quantizer recipe, e.g. int8-dynamic")
    p.add_argument("--quantize-option", action="append", metavar="KEY=VALUE", help="recipe option (repeatable)")
    p.add_argument("--backend-option", action="append", metavar="BACKEND.KEY=VALUE", help="partitioner option")
    p.add_argument("--transforms", help="extra source transforms by name, comma-separated")
    p.add_argument("--skip-transforms", help="automatic source transforms not to apply, e.g. kv-cache")
    p.add_argument("--max-seq-len", type=int, help="longest sequence the program accepts")
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
    chat.add_template_option(p, "the chat template to record in tokenizer_config.json, in place of the checkpoint's")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("-o", "--output", help="the .pte to write")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("plugins", help="list installed plugins and what they provide")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("run", help="generate text with a .pte program")
    p.add_argument("pte")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    chat.add_template_option(p, "with --chat (which it implies), the chat template in place of the program's")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the one next to the .pte)")
    p.add_argument("--json", action="store_true", help="print ids, text and stats as one JSON object")
    p.add_argument("--json-schema", metavar="FILE",
                   help="constrain the reply to this JSON schema: it always parses and matches it")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_run)
    from llmcore import inspect as inspect_command, profile as profile_command
    inspect_command.add_parser(sub), profile_command.add_parser(sub)
    from llmcore import evaluate, matrix, serve

    evaluate.add_parser(sub)
    matrix.add_parser(sub)
    serve.add_parser(sub)
    chat.add_parser(sub)
    for name in RUNTIME_COMMANDS:  # the commands that run a program: one thread-pool option for all
        sub.choices[name].add_argument(
            "--threads", type=int, metavar="N",
            help="CPU threads of the ExecuTorch runtime (XNNPACK and the LLM ops); default: one for a "
                 "program under 16 MiB, else one per core, as llmcore_runner --threads")
        sub.choices[name].add_argument(
            "--mmap", action="store_true",
            help="map the program's file instead of reading it into huge pages: a smaller resident set, "
                 "a slower decode (as llmcore_runner --mmap)")
    return parser


def console_main() -> int:
    """The ``llmcore`` command and ``python -m llmcore``: :func:`main`, then
    :func:`freeze_before_exit`. Not in :func:`main`, which tests and other programs call in
    their own process."""
    code = main()
    freeze_before_exit()
    if code == EXIT_INTERRUPTED:
        die_of_sigint()
    return code


def die_of_sigint() -> None:
    """End the process killed by SIGINT, as any program Ctrl-C stops, after its one line.

    A shell reads that as status 130 and stops a loop or script around the command (a plain
    ``exit(130)`` does not tell it the user pressed Ctrl-C), and Python's ``subprocess`` reads
    ``-SIGINT``. It is also the only status Python 3.11 lets ``python -m llmcore`` give
    reliably: when a caught KeyboardInterrupt had passed through an ``exec``/``eval`` of a
    string on its way up (dataclasses and sympy run such strings all through an export),
    the interpreter still counts it as unhandled and, after ``exit(130)``, kills itself with
    SIGINT, so the status depended on where the Ctrl-C landed (CI saw ``-2`` once for
    ``ctrl-c-during-lower``).
    Everything the command wrote or removed is done by now; atexit handlers do not run."""
    if os.name != "posix":
        return
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


def freeze_before_exit() -> None:
    """Keep the garbage collector off everything a command built, for a process about to end.

    An export leaves ~650,000 objects behind (graphs, fake tensors, sympy expressions), and
    Python's shutdown runs the collector over them while it tears the modules down: 2.1 s
    of SmolLM2-135M's export came after its last line (0.2 s with this). Frozen objects are
    skipped by the collector; acyclic ones are still freed and atexit handlers still run,
    and the system takes the memory back when the process ends."""
    gc.disable()
    gc.freeze()


def main(argv: Optional[Sequence[str]] = None) -> int:
    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    if words:
        set_up_threads(words[0])  # before the parser's imports bring in torch
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("LLMCORE_DEBUG") == "1"
    _quiet_libraries(debug)
    try:
        if args.command in ("export", "run", "inspect", "profile", "eval"):
            _quiet_torch(debug)
        if args.command in RUNTIME_COMMANDS:
            from llmcore.runtime import default_threads, use_threads

            threads = args.threads if args.threads is not None else default_threads(args.pte)
            if threads is not None:
                use_threads(threads)
            if args.mmap:
                from llmcore.runtime import map_program_files

                map_program_files()
        return args.func(args)
    except LlmcoreError as exc:
        if debug:
            traceback.print_exc()
        print(f"llmcore: error: {exc.one_line()}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("llmcore: interrupted; nothing was written.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except MemoryError:
        if debug:
            traceback.print_exc()
        print(
            "llmcore: error: ran out of memory (MemoryError); nothing was written. Fix: close other programs, "
            "pass a smaller --max-seq-len, or run on a machine with more memory.",
            file=sys.stderr,
        )
        return EXIT_ERROR
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # a bug (or a native library's panic): still one line
        if debug:
            traceback.print_exc()
        text = " ".join(str(exc).split())[:300]
        print(
            f"llmcore: internal error: {type(exc).__name__}: {text} "
            "(run with --debug for the traceback and report it)",
            file=sys.stderr,
        )
        return 1
