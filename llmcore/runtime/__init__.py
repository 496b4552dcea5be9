"""Running programs: everything between a written ``.pte`` and generated text.

* :mod:`~llmcore.runtime.pte` reads a program's table (methods, operators, delegates,
  constant methods) without running it; :mod:`~llmcore.runtime.program_bytes` reads its
  file into memory; :mod:`~llmcore.runtime.libraries` loads the kernel libraries it needs;
* :mod:`~llmcore.runtime.program` loads and calls it with the ExecuTorch runtime
  (:class:`Program`) and sizes the runtime's threads;
* :mod:`~llmcore.runtime.generate` tokenizes, samples and runs the decode loop;
  :mod:`~llmcore.runtime.constrain` keeps a reply inside a grammar (a JSON schema, a tool
  call); :mod:`~llmcore.runtime.chat_template` writes conversations as the model was
  trained on them; :mod:`~llmcore.runtime.session` keeps a program's KV cache between
  requests (``serve``, ``chat``);
* :mod:`~llmcore.runtime.agreement` checks the C++ runner against this runtime.

Nothing here imports the applications (:mod:`llmcore.apps`) or the command line.

The names of :mod:`~llmcore.runtime.program` are importable from here
(``from llmcore.runtime import Program``); they load on first use, so that reading a
program's table or its chat template does not import torch.
"""

from __future__ import annotations

from typing import Any

_PROGRAM_NAMES = (
    "METADATA_METHODS",
    "ONE_THREAD_BELOW_BYTES",
    "Program",
    "backend_target",
    "captured_stderr",
    "default_threads",
    "feed_in_chunks",
    "load_error",
    "load_method",
    "map_program_files",
    "missing_backends",
    "registered_backends",
    "runtime_threads",
    "torch_on_one_thread",
    "torch_threads_after_custom_ops",
    "use_threads",
)
__all__ = list(_PROGRAM_NAMES)


def __getattr__(name: str) -> Any:
    if name in _PROGRAM_NAMES:
        from llmcore.runtime import program

        return getattr(program, name)
    raise AttributeError(f"module 'llmcore.runtime' has no attribute {name!r}")
