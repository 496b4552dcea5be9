"""Stage 8: write the outputs atomically.

Every file goes to a temporary name in the destination folder first; only when all of
them are complete are they renamed into place. A failure or Ctrl-C before that leaves
no `.pte` (and no half-written anything) behind.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Optional

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
        self._staged.append((Path(tmp), final))
        try:
            os.fchmod(fd, _file_mode())  # mkstemp's 0600 would make the outputs private
        except OSError:
            pass
        finally:
            os.close(fd)
        return Path(tmp)

    def stage(self, final: Path, data: "bytes | str | Callable[[BinaryIO], None]") -> Path:
        """Write ``data`` (or let it write itself: a callable given the open file, e.g. an
        ExecuTorch program's ``write_to_file``, which never joins its parts in memory) to a
        temporary file next to ``final``."""
        tmp = self.reserve(final)
        try:
            with open(tmp, "wb") as f:
                if callable(data):
                    data(f)
                else:
                    f.write(data.encode("utf-8") if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            self.discard()
            raise _write_error(final, exc) from None
        return tmp

    def commit(self) -> list[Path]:
        """Rename every staged file into place, the ``.pte`` last; if any rename fails (or
        Ctrl-C lands in between), the ones already renamed are removed again."""
        done: list[Path] = []
        order = sorted(self._staged, key=lambda staged: staged[1].suffix == ".pte")
        final = None
        try:
            for tmp, final in order:
                os.replace(tmp, final)
                done.append(final)
        except BaseException as exc:
            for path in done:
                try:
                    path.unlink()
                except OSError:
                    pass
            self.discard()
            if isinstance(exc, OSError):
                raise _write_error(final, exc) from None
            raise
        self._staged.clear()
        return done

    def discard(self) -> None:
        for tmp, _ in self._staged:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
        self._staged.clear()


def check_folder(output: Path, flag: str = "-o") -> None:
    """Fail early if the folder ``output`` goes into is missing, a file, or read-only."""
    folder = output.parent
    if folder.exists() and not folder.is_dir():
        raise LlmcoreError(
            f"output folder {str(folder)!r} is not a folder but a file.",
            stage="write",
            fix=f"pass {flag} with a path inside a folder.",
        )
    if not folder.is_dir():
        raise LlmcoreError(
            f"output folder {str(folder)!r} does not exist.",
            stage="write",
            fix=f"create it first, or pass another {flag}.",
        )
    if output.is_dir():
        raise LlmcoreError(
            f"output {str(output)!r} is a folder.",
            stage="write",
            fix=f"pass {flag} with the path of the file to write, not a folder.",
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise LlmcoreError(
            f"output folder {str(folder)!r} is not writable.",
            stage="write",
            fix=f"pass {flag} with a folder you can write to.",
        )


def check_writable(output: Path) -> None:
    """Fail before the long stages if the output folder cannot take the files."""
    check_folder(output)
    if output.suffix != ".pte":
        raise LlmcoreError(
            f"output {str(output)!r} should end in .pte.",
            stage="write",
            fix="pass -o NAME.pte.",
        )


def _file_mode() -> int:
    """The mode a plain ``open()`` would give a new file (0666 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _write_error(path: Optional[Path], exc: OSError) -> LlmcoreError:
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free some disk space (or raise your quota) and export again, or pass -o on another disk."
    elif exc.errno == errno.EFBIG:
        reason += " (the file-size limit, `ulimit -f`, or the file system's largest file)"
        fix = "raise the file-size limit (ulimit -f unlimited) or pass -o on another file system."
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "pass -o with a folder you can write to."
    else:
        fix = "check the output folder and its permissions."
    return LlmcoreError(f"could not write {str(path)!r}: {reason}; nothing was written.", stage="write", fix=fix)
