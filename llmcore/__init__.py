"""llmcore: export PyTorch LLMs to ExecuTorch programs through plugins, and run them.

From Python (``docs/python-api.md``): :func:`export` in one call, :func:`export_steps` for
the same export stage by stage, :func:`load` to generate with a written program. Those names
load on first use, so that ``import llmcore`` (and plugin discovery, which imports it) stays
cheap: no torch, no ExecuTorch.
"""

from typing import Any

__version__ = "0.1.0"

from llmcore.hookspecs import hookimpl  # noqa: E402  (the one name plugin authors import)

# name -> the module that defines it, imported when the name is first used
_LAZY = {
    "export": "llmcore.api",
    "export_steps": "llmcore.api",
    "export_options": "llmcore.api",
    "load": "llmcore.api",
    "Model": "llmcore.api",
    "Completion": "llmcore.api",
    "Export": "llmcore.pipeline",
    "ExportResult": "llmcore.pipeline",
    "ExportPlan": "llmcore.pipeline.plan",
    "ExportOptions": "llmcore.recipe",
    "LlmcoreError": "llmcore.errors",
}

__all__ = ["__version__", "hookimpl", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llmcore' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
