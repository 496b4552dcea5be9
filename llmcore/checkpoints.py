"""Checking a checkpoint's tensors against the model they are meant for, for loaders.

A loader that builds a model and fills it from a file calls :func:`check_state_dict`
before ``load_state_dict``: a file for another config, or one cut short, then fails with
one line that names the missing, unexpected and misshapen tensors as the file names them,
instead of a wall of ``size mismatch`` lines from PyTorch.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from llmcore.errors import LlmcoreError


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(value, "shape", value))


def check_state_dict(
    model_state: Mapping[str, Any],
    loaded: Mapping[str, Any],
    *,
    plugin: str,
    source: str,
    fix: str,
    file_name: Callable[[str], str] = str,
) -> None:
    """Raise a one-line :class:`LlmcoreError` (stage ``load``) when ``loaded`` does not fit
    ``model_state`` (both map names to tensors or shapes): ``"<source>: missing N
    tensor(s): a, b, c, ...; unexpected ...; wrong shape for ... (e.g. k: [..], expected
    [..])."``, at most three names of each kind.

    ``source`` says what did not fit what (``"checkpoint 'x.pt' does not fit a GPT-2 with
    n_layer=12, ..."``); ``file_name`` maps a model key to the name the file uses."""
    expected = {k: _shape(v) for k, v in model_state.items()}
    given = {k: _shape(v) for k, v in loaded.items()}
    missing = sorted(set(expected) - set(given))
    extra = sorted(set(given) - set(expected))
    wrong = sorted(k for k in set(expected) & set(given) if given[k] != expected[k])

    def names(keys: list[str]) -> str:
        shown = ", ".join(file_name(k) for k in keys[:3])
        return f"{len(keys)} tensor(s): {shown}" + (", ..." if len(keys) > 3 else "")

    problems = []
    if missing:
        problems.append(f"missing {names(missing)}")
    if extra:
        problems.append(f"unexpected {names(extra)}")
    if wrong:
        k = wrong[0]
        problems.append(
            f"wrong shape for {names(wrong)} (e.g. {file_name(k)}: {list(given[k])}, expected {list(expected[k])})"
        )
    if problems:
        raise LlmcoreError(f"{source}: " + "; ".join(problems) + ".", stage="load", plugin=plugin, fix=fix)
