"""The applications on top of the export pipeline and the runtime, one module each:

* :mod:`~llmcore.apps.inspect`: ``llmcore inspect``, what a program needs and whether this
  runtime has it;
* :mod:`~llmcore.apps.profile`: ``llmcore profile``, operator timings of a generation;
* :mod:`~llmcore.apps.evaluate`: ``llmcore eval``, perplexity of a program and of its eager model;
* :mod:`~llmcore.apps.matrix`: ``llmcore matrix``, many exports at once on Ray (the
  ``matrix`` extra);
* :mod:`~llmcore.apps.serve`: ``llmcore serve``, an OpenAI-compatible HTTP server (the
  ``serve`` extra);
* :mod:`~llmcore.apps.chat`: ``llmcore chat``, a conversation in the terminal.

This package is a built-in plugin (:data:`llmcore.plugins.BUILTIN_PLUGINS`): its commands
reach the command line through the ``llmcore_commands`` hook, as a third-party plugin's
would. The core and the runtime never import from here.
"""

from __future__ import annotations

from llmcore.hookspecs import hookimpl
from llmcore.records import Command, Lazy


def _command(name: str, module: str, help: str, run: str, **kwargs) -> Command:
    """A command whose module (``llmcore.apps.MODULE``) is imported only when its parser is built."""
    path = f"llmcore.apps.{module}"
    return Command(name, help=help, add_arguments=Lazy(path, "add_arguments"), run=Lazy(path, run), **kwargs)


@hookimpl
def llmcore_commands() -> list[Command]:
    return [
        _command("inspect", "inspect", "what a .pte needs (methods, metadata, backends, operators) and whether this "
                 "runtime has it", "cmd_inspect"),
        _command("profile", "profile", "time a generation per operator (ETDump + Inspector), prefill and decode apart",
                 "cmd_profile", runs_program=True),
        _command("eval", "evaluate", "perplexity of a .pte and of its eager model on a text", "cmd_eval",
                 runs_program=True, eager=True),
        _command("matrix", "matrix", "export every model x backends x recipe of a YAML matrix, on Ray", "cmd_matrix",
                 extra="matrix", needs=("ray",)),
        _command("serve", "serve", "an OpenAI-compatible HTTP server over a .pte program", "cmd_serve",
                 runs_program=True, extra="serve", needs=("starlette", "uvicorn", "llguidance")),
        _command("chat", "chat", "a multi-turn chat with a .pte program in the terminal", "cmd_chat",
                 runs_program=True),
    ]
