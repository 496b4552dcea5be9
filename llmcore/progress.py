"""Stage timing: wall time and memory per pipeline stage, with progress on stderr."""

from __future__ import annotations

import resource
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterator


def current_rss_mib() -> float:
    """Resident set size of this process now, from /proc (0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize() / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


@dataclass
class StageRecord:
    name: str
    wall_s: float
    rss_mib: float
    """Resident memory when the stage ended."""
    peak_rss_mib: float
    """Process peak so far when the stage ended: the stage's peak if it set a new one."""


class StageLog:
    """Times stages; prints ``[llmcore] stage ...`` lines and a heartbeat on stderr."""

    def __init__(self, quiet: bool = False, heartbeat_s: float = 15.0):
        self.quiet = quiet
        self.heartbeat_s = heartbeat_s
        self.records: list[StageRecord] = []

    def say(self, text: str) -> None:
        if not self.quiet:
            print(f"[llmcore] {text}", file=sys.stderr, flush=True)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        self.say(f"{name} ...")
        done = threading.Event()

        def heartbeat() -> None:
            while not done.wait(self.heartbeat_s):
                self.say(f"{name}: still working ({time.perf_counter() - start:.0f}s)")

        ticker = None
        if not self.quiet:
            ticker = threading.Thread(target=heartbeat, daemon=True)
            ticker.start()
        try:
            yield
        finally:
            done.set()
            if ticker is not None:
                ticker.join()
        wall = time.perf_counter() - start
        record = StageRecord(name, round(wall, 3), round(current_rss_mib(), 1), round(peak_rss_mib(), 1))
        self.records.append(record)
        self.say(f"{name} done in {wall:.1f}s (peak RSS {record.peak_rss_mib:.0f} MiB)")

    def as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]
