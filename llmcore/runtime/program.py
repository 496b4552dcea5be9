"""Loading and calling `.pte` programs with the ExecuTorch runtime (pybindings).

Kernels outside the runtime's built-in set (ExecuTorch's LLM custom ops and quantized
kernels, plugins' custom operators: ``RuntimeLibrary`` records) must be loaded in the
process that runs a program, not only in the one that exported it, or loading fails with
``Missing operator ... error 0x14``: :meth:`Program.load` loads those the program's
operators need (:func:`llmcore.runtime.libraries.load_program_libraries`).
"""

from __future__ import annotations

import mmap
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

import numpy as np
import torch

from llmcore.runtime import pte
from llmcore.errors import LlmcoreError
from llmcore.runtime.libraries import (
    load_preloaded_libraries,
    load_program_libraries,
    missing_library_hint,
    prepare_libraries,
    runtime_bindings,
)
from llmcore.runtime.program_bytes import read_program_bytes

METADATA_METHODS = {
    "get_max_seq_len": int,
    "get_max_context_len": int,
    "get_vocab_size": int,
    "get_bos_id": int,
    "get_n_bos": int,
    "get_eos_ids": list,
    "use_kv_cache": bool,
    "use_sdpa_with_kv_cache": bool,
    "enable_dynamic_shape": bool,
}

T = TypeVar("T")


class Program:
    """A loaded `.pte`: its metadata and a ``logits(tokens, input_pos)`` call."""

    def __init__(self, module: Any, source: str, data: Any):
        self._module = module
        self._data = data  # the memory the runtime reads the program from: must outlive the module
        self.source = source
        self.method_names = set(module.method_names())
        self.metadata: dict[str, Any] = {}
        for name, kind in METADATA_METHODS.items():
            if name in self.method_names:
                values = module.run_method(name, [])
                self.metadata[name] = values if kind is list else kind(values[0])
        meta = self.metadata
        self.use_kv_cache: bool = meta.get("use_kv_cache", False)
        self.max_seq_len: int = meta.get("get_max_seq_len", 128)
        self.max_context_len: int = meta.get("get_max_context_len", self.max_seq_len)
        self.eos_ids: list[int] = [int(i) for i in meta.get("get_eos_ids", [])]
        self.bos_id: int = meta.get("get_bos_id", -1)
        self.n_bos: int = meta.get("get_n_bos", 0)
        self.runtime_libraries: list[str] = (
            [str(v) for v in module.run_method("get_runtime_libraries", [])]
            if "get_runtime_libraries" in self.method_names
            else []
        )
        # A decode step's inputs, made once and refilled through numpy views. Right after a
        # forward call the runtime's pool threads still spin on this machine's other core,
        # and everything the loop does between calls runs several times slower than idle
        # (making two small tensors included): the less Python work per token, the closer
        # the Python loop is to the C++ runner (docs/performance.md, "Measurements behind
        # the code").
        step_ids, step_pos = torch.zeros((1, 1), dtype=torch.long), torch.zeros(1, dtype=torch.long)
        self._step_inputs = [step_ids, step_pos]
        self._step_ids, self._step_pos = step_ids.numpy(), step_pos.numpy()

    @classmethod
    def load(cls, source: str | Path | bytes, *, enable_etdump: bool = False,
             map_file: Optional[bool] = None) -> "Program":
        """Load a program, with the kernel libraries its operators need
        (:func:`llmcore.runtime.libraries.load_program_libraries`). A file is read into memory backed
        by huge pages, its data on a 2 MiB boundary (:func:`llmcore.runtime.program_bytes.read_program_bytes`,
        as ``llmcore_runner`` does), or with ``map_file`` (default: :func:`map_program_files`'
        setting, ``--mmap``) mapped by the runtime: a smaller resident set, a slower decode."""
        if isinstance(source, (bytes, bytearray)):
            data = bytes(source)
            return cls._load(data, "<buffer>", enable_etdump, None, keep=data)
        path = Path(source)
        if not path.is_file():
            raise LlmcoreError(
                f"program {str(path)!r} does not exist.", stage="run", fix="check the path of the .pte file."
            )
        if not (_MAP_FILES if map_file is None else map_file):
            memory = read_program_bytes(path)
            return cls._load(memory.data, str(path), enable_etdump, None, keep=memory)
        # Check through a read-only mapping and let the runtime map the file itself: the
        # weights are then paged in from disk, not held in a Python bytes object too.
        with open(path, "rb") as f:
            try:
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                data = b""
        try:
            return cls._load(data, str(path), enable_etdump, path)
        finally:
            if isinstance(data, mmap.mmap):
                data.close()

    @classmethod
    def _load(cls, data, label: str, enable_etdump: bool, path: Optional[Path], keep: Any = None) -> "Program":
        """``keep``: what holds the memory of ``data`` the runtime will run from (None where
        the runtime maps ``path`` itself)."""
        load_preloaded_libraries()  # before the bindings' libraries load: see the function
        bindings = runtime_bindings()
        pte.check_header(data, label, stage="run")
        load_program_libraries(data)
        prepare_libraries(data)
        if missing_backends(data):  # running a delegate with no backend can crash the process
            raise load_error(label, data, RuntimeError("a delegate's backend is not registered"))
        with captured_stderr() as runtime_log:
            try:
                if path is not None:
                    module = bindings._load_for_executorch(
                        str(path), enable_etdump=enable_etdump, debug_buffer_size=0
                    )
                else:
                    module = bindings._load_for_executorch_from_buffer(
                        data, enable_etdump=enable_etdump, debug_buffer_size=0
                    )
                program, failure = cls(module, label, keep), None
                if "forward" in program.method_names:
                    load_method(module, "forward")
                _start_thread_pool(bindings)
            except Exception as exc:
                failure = exc
        if failure is not None:
            raise load_error(label, data, failure, runtime_log.text()) from failure
        return program

    def logits(self, tokens: Sequence[int], input_pos: Optional[int] = None) -> torch.Tensor:
        """Logits ``[V]`` for the last of ``tokens``, a copy the caller keeps; with a KV cache,
        ``tokens`` are fed in calls of at most ``max_seq_len`` (the prefill chunk of a
        ring-buffered program)."""
        return _own_last_row(self._forward(tokens, input_pos))

    def read_logits(self, tokens: Sequence[int], input_pos: Optional[int], read: Callable[[Any], T]) -> T:
        """``read(row)`` on the logits for the last of ``tokens`` where the program left them,
        and what it returns: ``row`` is a numpy view (or, for dtypes numpy lacks, a tensor)
        that the program's next call overwrites, so nothing may use it after that call
        (``llmcore serve``'s engine hands it on, to be sampled before its next call).

        A decode loop's way to sample: right after a call of the program its weights have
        swept this core's caches, and every step of Python run then is slow (the first
        torch or numpy call, a copy of SmolLM2's 49152 logits, each torch call of a greedy
        sampler; docs/performance.md, "Measurements behind the code"). Sampling from the view
        with numpy skips the copy and the tensor calls, and cuts what ``generate`` spends
        outside ``run_method`` (docs/performance.md, "What was tried": logits lent where they
        lie)."""
        return read(_last_row_view(self._forward(tokens, input_pos)))

    def _forward(self, tokens: Sequence[int], input_pos: Optional[int]) -> torch.Tensor:
        if self.use_kv_cache:
            return feed_in_chunks(self._call, tokens, input_pos or 0, self.max_seq_len)
        return self._call(tokens, input_pos)

    def _call(self, tokens: Sequence[int], input_pos: Optional[int] = None) -> torch.Tensor:
        """The program's output for one call; it aliases the method's memory, which the next
        call overwrites. The bindings' own copy (``clone_outputs=True``) is an ATen copy: for
        49152 logits it starts OpenMP's team, whose helper thread then spins beside the
        runtime's pool (see :func:`_own_last_row`)."""
        if self.use_kv_cache and len(tokens) == 1:  # a decode step: the same two tensors, refilled
            self._step_ids[0, 0], self._step_pos[0] = tokens[0], input_pos or 0
            inputs = self._step_inputs
        else:
            inputs = [torch.tensor([list(tokens)], dtype=torch.long)]
            if self.use_kv_cache:
                inputs.append(torch.tensor([input_pos or 0], dtype=torch.long))
        try:
            return self._module.run_method("forward", inputs, clone_outputs=False)[0]
        except Exception as exc:
            raise LlmcoreError(
                f"running {self.source!r} failed: {type(exc).__name__}: {exc}",
                stage="run",
                fix="check that the program was exported by this version of llmcore and its backends run here (llmcore inspect).",
            ) from exc

    def __del__(self) -> None:
        # the runtime runs the program from self._data's memory: the module goes first
        self.__dict__.pop("_module", None)

    @property
    def module(self) -> Any:
        """The underlying pybindings module (for ETDump access)."""
        return self._module


def _own_last_row(out: torch.Tensor) -> torch.Tensor:
    """The last row of ``out`` (``[..., V]``), copied on the calling thread alone.

    ATen splits a copy of more than 32768 elements between OpenMP threads. After that, the
    OpenMP helper thread spins for a while on the other core, and a decode step runs beside
    it, much slower in a process that has not set ``OMP_NUM_THREADS=1``. numpy's copy is
    one ``memcpy``, and the row is found in numpy too: the first ATen operation after a
    call of the method is slow whatever it does, so the reshape and index cost a decode
    step more in ATen than here (docs/performance.md, "Measurements behind the code", and
    "What was tried": the logits' last row found and copied in numpy)."""
    row = _last_row_view(out)
    return torch.from_numpy(row.copy()) if isinstance(row, np.ndarray) else row


def _last_row_view(out: torch.Tensor) -> "np.ndarray | torch.Tensor":
    """The last row of ``out`` as a numpy view of its memory; dtypes numpy lacks (bfloat16)
    as a tensor, copied by ATen on one thread."""
    try:
        values = out.numpy()
    except TypeError:
        with torch_on_one_thread():
            return out.reshape(-1, out.shape[-1])[-1].clone()
    return values.reshape(-1, values.shape[-1])[-1]


def load_method(module: Any, name: str) -> None:
    """Load method ``name`` of a pybindings module now, without running it, as the C++
    runner does at start-up: the backends' set-up (XNNPACK packs its weights) then counts
    in loading, not in the first call's time to first token, and a missing operator fails
    the load.

    The module loads a method on its first execution and has no call that only loads it
    (``_load_program`` does, but reads the program's constants into memory where the
    module maps the file: more resident memory, the int8 embedding table's pages among it;
    docs/performance.md, "Measurements behind the code"). Executing
    the plan before any input is set loads the method, and ``Method::execute`` then refuses
    to run with ``InvalidArgument`` (0x12) before its first instruction: that refusal is
    the expected outcome; any other error is the load's."""
    try:
        module.plan_execute(name)
    except RuntimeError as exc:
        if "error: 0x12" not in str(exc):
            raise


# Below this size a program's operators are too small for a second thread to pay for
# waking it: random nanoGPTs of growing width decoded faster on one thread while small,
# alike near this size and faster on two above it (docs/performance.md, "Threads").
# ``llmcore_runner`` applies the same rule (runtime/src/main.cpp).
ONE_THREAD_BELOW_BYTES = 16 << 20


def default_threads(program: str | Path) -> Optional[int]:
    """The thread count a command runs ``program`` with when ``--threads`` is not given:
    one for a program under :data:`ONE_THREAD_BELOW_BYTES`, else ``None`` (the runtime's
    own choice, one thread per core). A path that is not a file gives ``None``; loading it
    reports the error."""
    try:
        size = Path(program).stat().st_size
    except (OSError, ValueError):
        return None
    return 1 if size < ONE_THREAD_BELOW_BYTES else None


def use_threads(count: int) -> None:
    """Give the runtime's CPU thread pool ``count`` threads (ExecuTorch's pool, which
    XNNPACK's delegates and the LLM custom ops share), before any program runs. The
    default, one thread per core, is not always the fastest: the tiny test model decoded
    faster with one thread, while SmolLM2 prefilled faster with two (docs/performance.md,
    "Threads")."""
    if count < 1:
        raise LlmcoreError(f"--threads {count} is not a thread count.", stage="run", fix="pass --threads 1 or more.")
    bindings = runtime_bindings()

    reset = getattr(bindings, "_unsafe_reset_threadpool", None)
    if reset is None:
        raise LlmcoreError("this ExecuTorch runtime cannot set its thread count.", stage="run",
                           fix="leave out --threads (the runtime uses one thread per core).")
    with captured_stderr():  # cpuinfo and the pool log their work on fd 2
        reset(count)


@contextmanager
def torch_on_one_thread() -> Iterator[None]:
    """Run PyTorch's own ops on one thread for a while (ExecuTorch's pool is not touched).

    A decode loop's own tensor ops (sampling over 49152 logits) are too small to share, and
    once split between OpenMP threads they leave OpenMP's helper spinning on the core the
    runtime's pool needs for the next forward call: ``llmcore.runtime.generate.generate`` and
    ``llmcore.runtime.session.run`` run under this.

    For series of small memory-bound ops (dequantizing a checkpoint, a quantizer's scale
    searches) a second thread gains little on an idle 2-core machine, and loses badly
    where the cores are busy (a GGUF's dequantization on a loaded host) or where OpenMP has
    stopped spinning. Once eager PyTorch has run ExecuTorch's LLM custom ops (an export's
    calibration), two-thread ops wake their helper with a system call each time, and an
    int4 search of a 576x576 matrix took several times as long on two threads as on one
    (docs/performance.md, "Measurements behind the code"). The cause: the runtime pool's
    workers start OpenMP teams of their own for BLAS, and libgomp, managing more threads
    than cores, stops letting idle ones spin; with the workers' OpenMP kept to one thread
    the slowdown is gone (:func:`torch_threads_after_custom_ops`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def torch_threads_after_custom_ops() -> Iterator[None]:
    """PyTorch's ops after eager runs of ExecuTorch's LLM custom ops (an export's calibration).

    Where each runtime worker's OpenMP keeps to one thread (``OMP_NUM_THREADS=1`` in the
    environment, which ``llmcore export`` sets before torch starts:
    ``llmcore.cli.one_openmp_thread_per_worker``), they run on the threads PyTorch has: the
    workers started no OpenMP teams of their own, and SmolLM2-135M's ``8da4w`` quantize
    stage was faster on every core than on one thread (docs/performance.md, "Measurements
    behind the code"). Elsewhere (a program that imported torch first) on one thread
    (:func:`torch_on_one_thread`). The results are the same on any thread count."""
    if os.environ.get("OMP_NUM_THREADS") == "1":
        yield
        return
    with torch_on_one_thread():
        yield


# Whether Program.load maps program files (--mmap) instead of reading them into huge pages.
_MAP_FILES = False


def map_program_files(enabled: bool = True) -> None:
    """Make :meth:`Program.load` map program files by default (``--mmap``)."""
    global _MAP_FILES
    _MAP_FILES = enabled


def _start_thread_pool(bindings) -> None:
    """Start the runtime's CPU thread pool now, if no call has yet. It starts on first use,
    and cpuinfo then writes its probing to fd 2 (five lines on x86: "Failed to open midr
    file", "CPU info and manual query on # of cpus dont match"); started inside a load's
    :func:`captured_stderr` they are kept off the terminal, where the first forward call
    printed them between an export's stage lines and before ``llmcore run``'s answer."""
    count = getattr(bindings, "_threadpool_get_thread_count", None)
    if count is not None:
        count()


def runtime_threads() -> int:
    """How many threads the runtime's CPU pool has now (what ``llmcore run --json`` reports)."""
    bindings = runtime_bindings()

    return int(bindings._threadpool_get_thread_count())


def feed_in_chunks(
    forward: Callable[[Sequence[int], int], torch.Tensor], tokens: Sequence[int], start: int, chunk: int
) -> torch.Tensor:
    """``forward(part, position)`` on consecutive parts of ``tokens`` of at most ``chunk``,
    from ``start``; the last call's logits. How a KV-cache program takes a prompt longer
    than one call accepts (docs/pte-contract.md)."""
    out = None
    for i in range(0, max(len(tokens), 1), max(chunk, 1)):
        out = forward(tokens[i : i + chunk], start + i)
    return out


class _Captured:
    def __init__(self) -> None:
        self.data = b""

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


@contextmanager
def captured_stderr() -> Iterator[_Captured]:
    """Collect what the C++ runtime logs on fd 2 while loading (cpuinfo chatter, the
    name of a missing operator or backend); ``LLMCORE_DEBUG=1`` lets it through."""
    captured = _Captured()
    if os.environ.get("LLMCORE_DEBUG") == "1":
        yield captured
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.data = sink.read()


def load_error(label: str, data: bytes, exc: BaseException, runtime_log: str = "") -> LlmcoreError:
    """Explain why the runtime refused a program: missing backend, op, or a damaged file."""
    text = str(exc)
    for line in runtime_log.splitlines():
        if "cpuinfo" in line or not line.strip():
            continue
        text = f"{line.split(']', 1)[-1].strip()}; {text}"  # the runtime's own reason first
        break
    missing = missing_backends(data)
    if missing:
        needs = "; ".join(f"{name}, which runs on {backend_target(name)}" for name in missing)
        try:
            have = ", ".join(sorted(registered_backends())) or "none"
        except Exception:
            have = "unknown"
        return LlmcoreError(
            f"{label!r} needs backend {needs}. This ExecuTorch runtime does not have it (it has: {have}).",
            stage="run",
            fix="run it with an ExecuTorch runtime built with that backend, on such a device, or export it again "
            "for a backend this runtime has (see `llmcore plugins`); `llmcore inspect` lists what a program needs.",
        )
    if "0x14" in text or "Missing operator" in text:
        return LlmcoreError(
            f"{label!r} uses an operator this runtime lacks ({text.strip()[:200]}).",
            stage="run",
            fix=missing_library_hint(data)
            or "load the plugin's runtime library, or export without the custom op (see `llmcore inspect`).",
        )
    return LlmcoreError(
        f"{label!r} could not be loaded; the file is truncated or damaged ({type(exc).__name__}: {text.strip()[:200]}).",
        stage="run",
        fix="export it again with `llmcore export`.",
    )


def backend_target(backend_id: str) -> str:
    """Where a backend's delegates run, in words: the ``runs_on`` of the installed plugin
    whose backend carries this delegate id; the core itself names no backend."""
    try:
        from llmcore.plugins import load_registry

        for provided in load_registry().all("backends"):
            if provided.record.runtime_id == backend_id and provided.record.runs_on:
                return provided.record.runs_on
    except Exception:  # an error message must not fail for want of plugins
        pass
    return f"a runtime built with the {backend_id} backend (install its llmcore plugin to learn more)"


def registered_backends() -> set[str]:
    bindings = runtime_bindings()

    return set(bindings._get_registered_backend_names())


def missing_backends(data: bytes) -> list[str]:
    """Backend ids of the program's delegates that this runtime has not registered (none
    when the program cannot be read: loading it reports that)."""
    try:
        have = registered_backends()
        ids = pte.delegate_ids(data)
    except Exception:
        return []
    return [d for d in ids if d not in have]
