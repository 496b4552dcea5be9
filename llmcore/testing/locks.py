"""One process at a time: what tests that build or export into a shared folder hold.

``make test`` runs pytest on every core (pytest-xdist), and each worker has its own session
fixtures; the ones that write something every worker reuses (the C++ runner's build folder,
the runtime tests' programs, the shared tiny exports) take this lock, so that the first
worker builds it and the others wait and find it done, instead of two ``cmake --build``
runs or two exports writing the same files at once.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def one_at_a_time(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_file`` (created if missing) for the block; the
    kernel releases it if the process dies, so a killed worker leaves no stale lock."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the lock


def shared_folder(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this run sees (the run's base temporary folder,
    above each worker's own); without xdist, the session's own."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
