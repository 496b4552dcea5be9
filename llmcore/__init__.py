"""llmcore: export PyTorch LLMs to ExecuTorch programs through plugins, and run them."""

__version__ = "0.1.0"

from llmcore.hookspecs import hookimpl  # noqa: E402  (the one name plugin authors import)

__all__ = ["__version__", "hookimpl"]
