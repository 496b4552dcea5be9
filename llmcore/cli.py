"""The ``llmcore`` command: export, plugins, run, inspect, profile, eval, serve, chat, matrix.

A thin layer: the commands are :class:`~llmcore.records.Command` records that plugins
register through the ``llmcore_commands`` hook, llmcore's own included (the core's
``export``, ``plugins`` and ``run`` in ``llmcore.builtins.commands``, the applications' in
``llmcore.apps``). What is here is what every command shares: ``--debug``, the threads set
up before torch is imported, the check that a command's extra is installed, and the errors.

Errors the user can act on are printed as one line (``llmcore: error: [stage/plugin] ...
Fix: ...``) with exit code 2; ``--debug`` adds the traceback. Unexpected exceptions exit
with code 1 and the same one-line treatment. Ctrl-C prints one line too, and the command
then ends killed by SIGINT (status 130 in a shell), as :func:`die_of_sigint` explains.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import traceback
import warnings
from typing import Optional, Sequence

from llmcore.errors import LlmcoreError, describe, require_extra

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
    """torch installs its own log handlers; quiet them after import."""
    if debug:
        return
    import torch._logging

    torch._logging.set_logs(all=logging.ERROR)
    logging.getLogger("torch").setLevel(logging.ERROR)


def one_openmp_thread_per_worker() -> bool:
    """Before OpenMP starts: one OpenMP thread for every thread that asks, the runtime's
    pool workers included; returns whether it was set here. ``custom_sdpa`` calls BLAS from
    those workers, and with the default (one OpenMP thread per core) each worker starts a
    team of its own: a decode then ran at half speed, and after an export's calibration
    every two-thread PyTorch op ran several times slower
    (``llmcore.runtime.torch_on_one_thread``; docs/performance.md, "Measurements behind the
    code"). ``torch.set_num_threads`` sets it for the calling thread only
    (:func:`torch_on_every_core`). An explicit ``OMP_NUM_THREADS``, or a torch already
    imported, is left alone."""
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


# ---- the parser: every command registered through the llmcore_commands hook ------------------


def build_parser() -> argparse.ArgumentParser:
    """``llmcore``'s parser, with a subcommand for each :class:`~llmcore.records.Command` the
    plugins register: llmcore's own (``llmcore.builtins.commands``, ``llmcore.apps``) and
    third-party ones. A command two plugins claim, or whose arguments could not be added,
    is still listed; using it is the one-line error that says why."""
    from llmcore.plugins import load_registry

    registry = load_registry()
    parser = argparse.ArgumentParser(prog="llmcore", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks and library logs")
    sub = parser.add_subparsers(dest="command", required=True)
    conflicts = {c.name: c.error() for c in registry.conflicts if c.kind == "commands"}
    for provided in registry.all("commands", by_name=False):
        command, plugin = provided.record, provided.plugin
        if command.name in conflicts:
            _unusable(sub, command, conflicts[command.name])
            continue
        try:  # on a parser of its own first: a plugin's bug, or an option defined twice, fails that command only
            _add_arguments(command, argparse.ArgumentParser(prog=f"llmcore {command.name}"))
        except Exception as exc:
            _unusable(sub, command, LlmcoreError(
                f"command {command.name!r} could not add its arguments: {describe(exc)}", stage="cli",
                plugin=plugin.name, fix=f"report it to the maintainers of {plugin.package}."))
            continue
        p = sub.add_parser(command.name, help=command.help)
        _add_arguments(command, p)
        p.set_defaults(func=command.run, _llmcore_command=command, _llmcore_distribution=plugin.distribution or plugin.name)
    return parser


def _add_arguments(command, p: argparse.ArgumentParser) -> None:
    """The command's arguments, and those of every command that runs a program
    (``Command.runs_program``)."""
    command.add_arguments(p)
    if not command.runs_program:
        return
    p.add_argument(
        "--threads", type=int, metavar="N",
        help="CPU threads of the ExecuTorch runtime (XNNPACK and the LLM ops); default: one for a "
             "program under 16 MiB, else one per core, as llmcore_runner --threads")
    p.add_argument(
        "--mmap", action="store_true",
        help="map the program's file instead of reading it into huge pages: a smaller resident set, "
             "a slower decode (as llmcore_runner --mmap)")


def _unusable(sub, command, error: LlmcoreError) -> None:
    """``llmcore NAME`` that takes any arguments and fails with ``error``."""
    p = sub.add_parser(command.name, help=command.help, add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs=argparse.REMAINDER)

    def refuse(args: argparse.Namespace) -> int:
        raise error

    p.set_defaults(func=refuse, _llmcore_command=None)


def _prepare(command, distribution: str, args: argparse.Namespace, limited: bool) -> None:
    """What ``llmcore`` does before any command runs: its extra checked, then the threads."""
    if command.needs:
        require_extra(f"llmcore {command.name}", command.extra, command.needs, stage=command.name,
                      distribution=distribution)
    if limited and not (command.runs_program and not command.eager):
        torch_on_every_core()  # eager PyTorch on the main thread, or no program beside it
    if command.runs_program:
        from llmcore.runtime import default_threads, map_program_files, use_threads

        threads = args.threads if args.threads is not None else default_threads(args.pte)
        if threads is not None:
            use_threads(threads)
        if args.mmap:
            map_program_files()


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

    An export leaves hundreds of thousands of objects behind (graphs, fake tensors, sympy
    expressions), and Python's shutdown runs the collector over them while it tears the
    modules down, seconds after the export's last line (docs/performance.md, "Measurements
    behind the code"). Frozen objects are skipped by the collector; acyclic ones are still
    freed and atexit handlers still run, and the system takes the memory back when the
    process ends."""
    gc.disable()
    gc.freeze()


def main(argv: Optional[Sequence[str]] = None) -> int:
    # Before the plugins' imports bring in torch: any command may run a program (export's
    # parity check does), whose runtime workers must not start OpenMP teams of their own.
    limited = one_openmp_thread_per_worker()
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("LLMCORE_DEBUG") == "1"
    _quiet_libraries(debug)
    try:
        _quiet_torch(debug)
        command = getattr(args, "_llmcore_command", None)
        if command is not None:
            _prepare(command, args._llmcore_distribution, args, limited)
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
