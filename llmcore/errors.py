"""The one error type users see.

Every failure llmcore can explain is raised as :class:`LlmcoreError`, carrying the stage
it happened in, the plugin involved, and what the user can do about it. The CLI prints it
as one line; the traceback appears only with ``--debug``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Optional, Union


class LlmcoreError(Exception):
    """A failure with a stage, a responsible plugin and a suggested fix."""

    def __init__(
        self,
        message: str,
        *,
        stage: Optional[str] = None,
        plugin: Optional[str] = None,
        fix: Optional[str] = None,
    ):
        super().__init__(message)
        self.message = message
        self.stage = stage
        self.plugin = plugin
        self.fix = fix

    def one_line(self) -> str:
        """``[stage/plugin] message. Fix: ...`` on one line."""
        where = "/".join(p for p in (self.stage, self.plugin) if p)
        text = " ".join(self.message.split())
        if self.fix and text and text[-1] not in ".!?":
            text += "."  # "... corrupt. Fix: ...", not "... corrupt Fix: ..."
        line = f"[{where}] {text}" if where else text
        if self.fix:
            line += f" Fix: {' '.join(self.fix.split())}"
        return line

    def __str__(self) -> str:
        return self.one_line()


class PluginConflictError(LlmcoreError):
    """Two plugins claim the same name for a backend, model family, recipe or pass."""


def choose_one_of(kind: str, name: str, available, *, stage: str, fix_hint: str = "") -> LlmcoreError:
    """An 'unknown NAME' error that lists what the user can choose from."""
    names = ", ".join(sorted(available)) or "(none installed)"
    fix = f"choose one of: {names}."
    if fix_hint:
        fix += f" {fix_hint}"
    return LlmcoreError(f"unknown {kind} {name!r}.", stage=stage, fix=fix)


def describe(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (at most ``limit`` characters of it), or the
    type's name alone when the message is empty."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first[:limit]}" if first else type(exc).__name__


@contextmanager
def stage_errors(
    stage: str,
    plugin: Optional[str],
    what: str,
    fix: Union[str, Callable[[BaseException], str]],
) -> Iterator[None]:
    """Run plugin (or ExecuTorch) code as part of a stage, so that what goes wrong is one
    :class:`LlmcoreError` that names the stage and the plugin::

        with stage_errors("transform", plugin, f"source transform {name!r} failed", fix="drop it"):
            module = transform.apply(module, context)

    An ``LlmcoreError`` passes through as it is (its message and fix are the plugin's own),
    with the stage and plugin filled in where it names none. Any other exception becomes
    ``"<what>: <Type>: <first line>"`` with ``fix`` (a string, or a function of the
    exception), chained to the original for ``--debug``. Ctrl-C and out-of-memory pass
    through untouched.
    """
    try:
        yield
    except LlmcoreError as exc:
        exc.stage = exc.stage or stage
        exc.plugin = exc.plugin or plugin
        raise
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as exc:
        raise LlmcoreError(
            f"{what}: {describe(exc)}",
            stage=stage,
            plugin=plugin,
            fix=fix(exc) if callable(fix) else fix,
        ) from exc


def read_text_file(path, what: str, stage: str, fix: str) -> str:
    """A UTF-8 text file's contents, or one :class:`LlmcoreError` naming ``what`` could not
    be read and why (missing, unreadable, not UTF-8)."""
    from pathlib import Path

    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LlmcoreError(
            f"cannot read {what} {str(path)!r}: {getattr(exc, 'strerror', None) or exc}.", stage=stage, fix=fix
        ) from None


def module_installed(name: str) -> bool:
    """Whether ``import name`` would find the module (it is not imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing, or broken
        return False


def require_extra(what: str, extra: Optional[str], modules: Iterable[str], *, stage: str,
                  distribution: str = "llmcore") -> None:
    """One :class:`LlmcoreError` when a module ``what`` needs is not installed, naming the
    optional-dependency group that brings it:
    ``llmcore serve needs the 'serve' extra: pip install 'llmcore[serve]' (missing: uvicorn)``."""
    missing = [m for m in modules if not module_installed(m)]
    if not missing:
        return
    if extra:
        raise LlmcoreError(f"{what} needs the {extra!r} extra: pip install '{distribution}[{extra}]' "
                           f"(missing: {', '.join(missing)})", stage=stage)
    raise LlmcoreError(f"{what} needs modules that are not installed: {', '.join(missing)}.", stage=stage,
                       fix="install the packages that provide them.")
