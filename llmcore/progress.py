"""Stage timing: wall time and memory per pipeline stage, with progress on stderr."""

from __future__ import annotations

import gc
import os
import resource
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterator


_LIBC = None
_interrupted = threading.Event()


@contextmanager
def interrupts_at_safe_points() -> Iterator[None]:
    """Within the block, Ctrl-C stops the command at the next safe point, not where it lands.

    A KeyboardInterrupt raised at whatever bytecode the signal finds can land in torch's own
    Python callbacks under C++ frames (a dispatch mode's ``__torch_dispatch__`` while
    exporting or lowering). Its C++ guards then unwind with the mode stack half restored, a
    check in a destructor fails, and the process aborts (SIGABRT in
    ``TorchDispatchModeTLS::set_mode``: CI saw ``ctrl-c-during-lower`` end with -6, output
    half made). Library code also swallows it: ExecuTorch 1.5.1's lowering runs a bare
    ``except:`` for every operator (``exir/program/_program.py``, ``keep``).

    So the first Ctrl-C only records the request and says so; the command raises
    KeyboardInterrupt itself, with nothing of torch's on the stack, at the next
    :func:`stop_if_interrupted`: the end of each stage, each calibration call, each module's
    read from the checkpoint file, each poll of a matrix. A second Ctrl-C raises at once,
    for a user who will not wait (and who takes the risk above).

    The handler is installed even where SIGINT was inherited as ignored (a shell's ``cmd &``
    or a test runner started that way): a long command that can be resumed should stop
    when it is told to, whatever started it. Outside the main thread the block changes
    nothing (Python delivers signals to the main thread only).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum, frame):
        if _interrupted.is_set():
            raise KeyboardInterrupt
        _interrupted.set()
        # os.write, not print: the handler may run while the main thread is inside a
        # print to stderr, and the buffered stream refuses a reentrant call
        os.write(2, b"[llmcore] Ctrl-C: stopping at the end of this step (Ctrl-C again stops at once)\n")

    _interrupted.clear()
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _interrupted.clear()


def stop_if_interrupted() -> None:
    """Raise KeyboardInterrupt if Ctrl-C was pressed inside :func:`interrupts_at_safe_points`
    (or a library swallowed the one a second Ctrl-C raised). Call it only where no torch
    operation or dispatch mode is on the stack: between steps, never inside one."""
    if _interrupted.is_set():
        raise KeyboardInterrupt


def _libc():
    """glibc, or None elsewhere (macOS, musl): the allocator tweaks below are then no-ops."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            _LIBC = libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else False
        except OSError:
            _LIBC = False
    return _LIBC or None


M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 128 * 1024
M_TRIM_THRESHOLD = -1
TRIM_THRESHOLD = 128 * 1024  # glibc's default, which a fixed mmap threshold leaves in place


def limit_heap_fragmentation() -> None:
    """Give every allocation of 128 KiB or more its own mapping, returned to the system when
    freed. glibc otherwise raises that threshold as large blocks are freed (up to 32 MiB),
    so weight-sized tensors land on the heap, and a heap with holes cannot shrink: an
    export that replaces its float weights (quantization, lowering) kept the dead ones
    resident, on its peak (docs/performance.md, "Measurements behind the code")."""
    global _heap_limited
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        _heap_limited = True


# Allocations a :func:`heap_for_temporaries` scope serves from the heap: a search's many
# temporaries; larger ones (a calibration call's 25 MiB of logits) keep their own mappings.
# With this threshold the calibration's scopes leave the export's peak where it was without
# them; 32 MiB with one scope over the whole calibration raised it (docs/performance.md,
# "Measurements behind the code").
TEMPORARIES_THRESHOLD = 4 * 2**20
# heap_for_temporaries(largest=...) for a scope around one weight's work (see there)
WEIGHT_TEMPORARIES = 64 * 2**20
_temporaries_depth = 0
_temporaries_largest = 0  # the outermost open scope's ``largest``
_heap_limited = False  # whether limit_heap_fragmentation set the threshold in this process


@contextmanager
def heap_for_temporaries(give_back: bool = True, largest: int = TEMPORARIES_THRESHOLD) -> Iterator[None]:
    """Let a loop that makes and drops many temporaries reuse heap pages, then hand back
    what it freed.

    Under :func:`limit_heap_fragmentation` every allocation of 128 KiB or more is a fresh
    mapping, and the kernel zero-fills each of its pages on first touch. A quantizer's
    search allocates such temporaries thousands of times, and the kernel's page faults
    became a large part of an export's quantize stage (docs/performance.md, "What was
    tried": heap pages reused, and "Measurements behind the code"). Inside this scope
    allocations up to :data:`TEMPORARIES_THRESHOLD` come from the heap, whose freed pages
    the next temporary reuses; when the outermost scope ends, the threshold is restored and
    the free pages go back to the system (``malloc_trim``), so the dead temporaries stay
    off the peak. Tensors that outlive the loop are best allocated before it: one left
    among the temporaries only keeps its own pages. Scopes nest; a no-op where
    :func:`limit_heap_fragmentation` has not set the threshold (glibc's own moving one then
    serves repeated temporaries from the heap already), or without glibc.

    ``give_back=False`` keeps the freed pages for the next scope, for a function called
    once per layer: trimmed after every call, each call faulted its pages in again
    (docs/performance.md, "Measurements behind the code"). What it keeps is one call's
    temporaries, until a scope that gives back ends or the stage does (:meth:`StageLog.stage`
    trims).

    ``largest``: the largest allocation served from the heap (the outermost scope's counts).
    A loop over a model's weights, one weight per scope (a recipe reading a layer from its
    file, a backend packing it), gives :data:`WEIGHT_TEMPORARIES`: its row slices are tens of
    MiB, and as fresh mappings their page faults took about as much time as the work itself
    (docs/performance.md, "Measurements behind the code")."""
    global _temporaries_depth, _temporaries_largest
    libc = _libc()
    if libc is None or not _heap_limited:
        yield
        return
    if _temporaries_depth == 0:
        _temporaries_largest = largest
        libc.mallopt(M_MMAP_THRESHOLD, largest)
        # and a temporary freed at the top of the heap stays there for the next one, where
        # free() would otherwise hand anything over 128 KiB back at once
        libc.mallopt(M_TRIM_THRESHOLD, 2 * largest)
    _temporaries_depth += 1
    try:
        yield
    finally:
        _temporaries_depth -= 1
        if _temporaries_depth == 0:
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
            if give_back:
                libc.malloc_trim(0)


def before_own_mapping(nbytes: int) -> None:
    """Call before allocating ``nbytes`` that a :func:`heap_for_temporaries` scope leaves to a
    mapping of their own (``nbytes`` >= its ``largest``): the heap's free pages go back first.

    Why: within a scope the heap keeps what its temporaries freed, for the next ones; a large
    allocation cannot reuse those pages and would be resident beside them. A calibration pass
    over a 1B model in the file reads each layer's weights as heap temporaries, then the output
    layer's 1 GiB of floats: without this the export's peak rose by about 400 MiB
    (docs/performance.md, "Measurements behind the code")."""
    if _temporaries_depth and nbytes >= _temporaries_largest:
        return_free_memory()


def return_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def current_rss_mib() -> float:
    """Resident set size of this process now, from /proc (0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize() / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far.

    Read from ``VmHWM`` where there is one: ``ru_maxrss`` carries over the parent's peak
    into a forked child, so a worker started by a big process would report the parent's."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def reset_peak_rss() -> None:
    """Start the peak (``VmHWM``) afresh from the current RSS, so that a long-lived process
    running one job after another (a Ray worker of ``llmcore matrix``) reports each job's
    own peak. Linux only; elsewhere the peak stays the process's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


@dataclass
class StageRecord:
    name: str
    wall_s: float
    rss_mib: float
    """Resident memory when the stage ended."""
    peak_rss_mib: float
    """Process peak so far when the stage ended: the stage's peak if it set a new one."""
    cpu_s: float = 0.0
    """CPU time of the process's threads during the stage (more than ``wall_s`` when it ran
    on several cores)."""


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
    def stage(self, name: str, collect: bool = True) -> Iterator[None]:
        """Time the stage. ``collect``: first free what the previous stages dropped (a graph
        and its program hold each other: only the cycle collector frees them), out of the
        way before this stage allocates its own. A full collection walks every live object,
        a cost an export feels (docs/performance.md, "Measurements behind the code");
        ``collect=False`` after a stage that drops no graph."""
        if collect:
            gc.collect()
        return_free_memory()
        start, cpu_start = time.perf_counter(), time.process_time()
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
        stop_if_interrupted()  # a Ctrl-C pressed during the stage stops the command here
        wall = time.perf_counter() - start
        return_free_memory()  # what the stage freed, so that the next one starts lower
        cpu = time.process_time() - cpu_start
        record = StageRecord(
            name, round(wall, 3), round(current_rss_mib(), 1), round(peak_rss_mib(), 1), round(cpu, 3)
        )
        self.records.append(record)
        self.say(f"{name} done in {wall:.1f}s (peak RSS {record.peak_rss_mib:.0f} MiB)")

    def as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]
