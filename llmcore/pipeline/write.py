"""Stage 8: write the outputs atomically.

Every file goes to a temporary name in the destination folder first; only when all of
them are complete are they renamed into place. A failure or Ctrl-C before that leaves
no `.pte` (and no half-written anything) behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from llmcore.errors import LlmcoreError


class OutputBundle:
    """Files staged for an atomic commit: ``stage(path, data)`` then ``commit()``."""

    def __init__(self) -> None:
        self._staged: list[tuple[Path, Path]] = []

    def reserve(self, final: Path) -> Path:
        """A temporary path next to ``final`` that something else can write into."""
        final = Path(final)
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent)
        except OSError as exc:
            raise _write_error(final, exc) from None
        os.close(fd)
        self._staged.append((Path(tmp), final))
        return Path(tmp)

    def stage(self, final: Path, data: bytes | str) -> Path:
        tmp = self.reserve(final)
        payload = data.encode("utf-8") if isinstance(data, str) else data
        try:
            with open(tmp, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            self.discard()
            raise _write_error(final, exc) from None
        return tmp

    def commit(self) -> list[Path]:
        done = []
        try:
            for tmp, final in self._staged:
                os.replace(tmp, final)
                done.append(final)
        except OSError as exc:
            self.discard()
            raise _write_error(final, exc) from None
        self._staged.clear()
        return done

    def discard(self) -> None:
        for tmp, _ in self._staged:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
        self._staged.clear()


def check_writable(output: Path) -> None:
    """Fail before the long stages if the output folder cannot take the files."""
    folder = output.parent
    if not folder.is_dir():
        raise LlmcoreError(
            f"output folder {str(folder)!r} does not exist.",
            stage="write",
            fix="create it first, or pass another -o.",
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise LlmcoreError(
            f"output folder {str(folder)!r} is not writable.",
            stage="write",
            fix="pass -o with a folder you can write to.",
        )
    if output.suffix != ".pte":
        raise LlmcoreError(
            f"output {str(output)!r} should end in .pte.",
            stage="write",
            fix="pass -o NAME.pte.",
        )


def _write_error(path: Path, exc: OSError) -> LlmcoreError:
    reason = exc.strerror or str(exc)
    fix = "free some disk space and export again." if exc.errno == 28 else "check the output folder and its permissions."
    return LlmcoreError(f"could not write {str(path)!r}: {reason}; nothing was written.", stage="write", fix=fix)
