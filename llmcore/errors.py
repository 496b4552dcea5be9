"""The one error type users see.

Every failure llmcore can explain is raised as :class:`LlmcoreError`, carrying the stage
it happened in, the plugin involved, and what the user can do about it. The CLI prints it
as one line; the traceback appears only with ``--debug``.
"""

from __future__ import annotations

from typing import Optional


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
