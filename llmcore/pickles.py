"""What a refused pickle checkpoint wanted to run, found without running it.

``torch.load(weights_only=True)`` refuses a pickle that references anything beyond
tensors and plain containers, but its message often names only an opcode ("Unsupported
operand 149"). :func:`foreign_globals` reads the pickle's opcodes with :mod:`pickletools`
(which never executes anything) and lists the callables it references, so that an error
can say "it asks to call posix.system".

:func:`load_plain_data` reads a pickle of plain data (dicts, strings, numbers) with an
unpickler that refuses every class and callable.
"""

from __future__ import annotations

import pickle
import pickletools
import zipfile
from pathlib import Path
from typing import Any

# Globals that plain PyTorch checkpoints reference.
_PLAIN = ("torch.", "collections.OrderedDict", "_codecs.encode", "numpy.core.multiarray._reconstruct",
          "numpy.dtype", "numpy.ndarray", "builtins.set", "builtins.frozenset", "builtins.bytearray")


def _pickles(path: Path):
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                if name.endswith(".pkl"):
                    yield archive.read(name)
    else:
        yield Path(path).read_bytes()


def foreign_globals(path: str | Path, limit: int = 3) -> list[str]:
    """Callables (``module.name``) a pickle file references beyond plain tensor data."""
    found: list[str] = []
    try:
        for data in _pickles(Path(path)):
            strings: list[str] = []
            for opcode, arg, _ in pickletools.genops(data):
                if isinstance(arg, str) and "UNICODE" in opcode.name:
                    strings = (strings + [arg])[-2:]
                name = None
                if opcode.name in ("GLOBAL", "INST") and isinstance(arg, str):
                    name = arg.replace(" ", ".")
                elif opcode.name == "STACK_GLOBAL" and len(strings) == 2:
                    name = ".".join(strings)
                if name and not name.startswith(_PLAIN) and name not in found:
                    found.append(name)
                    if len(found) >= limit:
                        return found
    except Exception:  # a damaged pickle: report what was found before the damage
        pass
    return found


class _PlainDataUnpickler(pickle.Unpickler):
    """Unpickles plain data only: every class or callable a pickle names is refused here,
    before anything is looked up or called (dicts, lists, tuples, strings, bytes, numbers,
    booleans and None need none)."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it references {module}.{name}")


def load_plain_data(path: str | Path) -> Any:
    """Read a pickle that holds plain data (nanoGPT's ``meta.pkl``, say) without running
    anything in it. Raises :class:`pickle.UnpicklingError` naming what a pickle that needs
    more asked for (a class or a callable such as ``posix.system``)."""
    with open(path, "rb") as f:
        return _PlainDataUnpickler(f).load()
