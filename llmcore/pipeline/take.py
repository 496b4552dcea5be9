"""Stage 4b: backends that run parts of the eager module on their own operators.

Some backends are not delegates: their work is a set of custom operators (run by a
:class:`~llmcore.records.RuntimeLibrary`) that the program calls by name, such as
llmcore-kernels' whole-layer operators. Such a backend cannot claim nodes of the captured
graph as a partitioner does, because its operators must be in the graph before it is
captured; it swaps modules instead (``Backend.takes_modules``), after quantization (its
operators run the quantized integers) and before ``torch.export``. The backends take in the
order of ``--plugins``, like partitioners, so ``--plugins kernels,xnnpack`` gives llmcore's
kernels what they can run and XNNPACK the rest, and ``--plugins xnnpack`` leaves the kernels
out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from llmcore.errors import LlmcoreError, stage_errors
from llmcore.plugins import Provided
from llmcore.records import ModulesTaken


@dataclass(frozen=True)
class Taken:
    """One backend's :class:`ModulesTaken`, with the backend's name (for the report)."""

    backend: str
    modules: ModulesTaken

    def summary(self) -> str:
        """One line for the export's log: what the backend runs, and the first reasons it left
        parts to the backends after it."""
        taken, left = self.modules.taken, self.modules.left
        if not taken:
            why = self.modules.note or (left[0] if left else "nothing it can run")
            return f"backend {self.backend!r} takes no part of the model: {why}"
        line = f"backend {self.backend!r} runs {_count(taken)}"
        if left:
            more = f" (and {len(left) - 2} more)" if len(left) > 2 else ""
            line += f"; leaves {len(left)} to the backends after it: {'; '.join(left[:2])}{more}"
        return line

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "taken": list(self.modules.taken), "left": list(self.modules.left),
                "note": self.modules.note}


def take_modules(module: Any, backends: Sequence[tuple[Provided, dict]]) -> list[Taken]:
    """Let each backend with ``takes_modules`` swap what it runs, in order; returns what each
    did. A backend that raises stops the export with its plugin named."""
    done: list[Taken] = []
    for provided, options in backends:
        takes = provided.record.takes_modules
        if takes is None:
            continue
        name = provided.record.name
        failed = f"backend {name!r} failed while taking the model's layers"
        with stage_errors("quantize", provided.plugin.name, failed,
                          f"drop {name} from --plugins to leave its parts to the other backends "
                          "(--debug shows the traceback)."):
            result = takes(module, options)
        if not isinstance(result, ModulesTaken):
            raise LlmcoreError(
                f"backend {name!r}: takes_modules returned {type(result).__name__}, not ModulesTaken.",
                stage="quantize", plugin=provided.plugin.name, fix="return llmcore.records.ModulesTaken.",
            )
        done.append(Taken(name, result))
    return done


def _count(names: Sequence[str]) -> str:
    """``layers.0 .. layers.29, norm, output`` -> ``30 layers, norm and output``."""
    layers = [n for n in names if n.startswith("layers.")]
    rest = [n for n in names if not n.startswith("layers.")]
    parts = ([f"{len(layers)} layer{'s' if len(layers) != 1 else ''}"] if layers else []) + rest
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
