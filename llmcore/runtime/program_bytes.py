"""A program file's bytes in memory laid out for the kernels that read weights from it.

ExecuTorch's Python bindings take a program as a ``bytes`` object and run it from that
object's memory in place (``_load_for_executorch_from_buffer``); llmcore's kernels read
their packed weights straight from it. Where ``path.read_bytes()`` puts those bytes is
bad for them twice over:

- Alignment. glibc serves an allocation this large from ``mmap``, 16 bytes past a page
  boundary, and a ``bytes`` object's data follows a 32-byte header: the program starts 48
  bytes past a cache line, and so does every weight the file aligned to 64. Half of the
  kernels' 32-byte weight loads then straddle two cache lines, and a decode step slows
  (docs/performance.md, "The Python loop: the program's bytes on a cache line", and
  "Measurements behind the code").
- Page size. 4 KiB pages cost a TLB miss every 4 KiB of a decode step's sweep over the
  weights (:func:`in_huge_pages`).

:func:`read_program_bytes` reads the file into an anonymous mapping advised for huge pages,
with the data on a 2 MiB boundary, as ``llmcore_runner`` does
(``runtime/src/mmap_data_loader.h``), and puts a ``bytes`` header in front of it: CPython
has no call that makes a ``bytes`` object over memory it did not allocate, and the bindings
accept nothing else. Where the interpreter's layout of ``bytes`` is not the one this
writes (another implementation, a free-threaded build) or the OS is not Linux, it falls
back to ``read_bytes`` and :func:`in_huge_pages`.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import struct
import sys
from pathlib import Path
from typing import Optional

_MADV_HUGEPAGE = 14  # back this range with transparent huge pages when it is first touched
_MADV_COLLAPSE = 25  # Linux 6.1+: back a range with huge pages now (mm/khugepaged.c)
_HUGE_PAGE = 2 << 20

# CPython's PyBytesObject up to its data: ob_refcnt, ob_type, ob_size, ob_shash.
_BYTES_HEADER = struct.Struct("nPnn")
# The object's reference count while a ProgramBytes holds its only reference: it never
# reaches zero, so CPython never hands the object to its allocator (whose free() would be
# given memory malloc never made).
_PINNED_REFCOUNT = 1 << 60

# Mappings whose bytes object something still referred to when its ProgramBytes went.
_KEPT_MAPPINGS: list[mmap.mmap] = []


def _madvise(address: int, length: int, advice: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0


def _data_address(data: bytes) -> int:
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value


def in_huge_pages(data: bytes) -> bool:
    """Ask the kernel to back ``data``'s whole 2 MiB pages with transparent huge pages now
    (``madvise(MADV_COLLAPSE)``, whatever the system's THP mode but ``never``); False where it
    cannot (another OS, an older kernel, no THP). Why: a decode step streams every weight once,
    and with 4 KiB pages that is a TLB miss every 4 KiB over pages scattered in physical memory;
    ``llmcore_runner`` reads programs into huge pages for the same reason
    (runtime/src/mmap_data_loader.h; docs/performance.md, "The program in huge pages").
    ``data`` must stay alive as long as the program that runs from it; its bytes do not change."""
    if not sys.platform.startswith("linux") or len(data) < 2 * _HUGE_PAGE:
        return False
    address = _data_address(data)
    start = (address + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    end = (address + len(data)) & ~(_HUGE_PAGE - 1)
    if end <= start:
        return False
    return _madvise(start, end - start, _MADV_COLLAPSE)


@functools.lru_cache(maxsize=1)
def _layout_is_known() -> bool:
    """Whether ``bytes`` objects here are the header :data:`_BYTES_HEADER` describes, then
    the data: checked on a live object, not assumed from the version (once a process)."""
    if sys.implementation.name != "cpython" or not sys.platform.startswith("linux"):
        return False
    probe = bytes(range(40))
    if _data_address(probe) - id(probe) != _BYTES_HEADER.size:
        return False
    fields = _BYTES_HEADER.unpack(ctypes.string_at(id(probe), _BYTES_HEADER.size))
    return fields[1] == id(bytes) and fields[2] == len(probe)


class ProgramBytes:
    """A program file's bytes (:attr:`data`, a ``bytes`` object) and the memory they live in.

    Keep it as long as the program runs from :attr:`data`. When it goes, the mapping is
    unmapped if nothing else refers to :attr:`data` any more, and kept for the rest of the
    process otherwise (a reference left in a traceback must not point at unmapped memory).
    """

    def __init__(self, data: bytes, mapping: Optional[mmap.mmap] = None):
        self.data = data
        self._mapping = mapping

    @property
    def aligned(self) -> bool:
        """Whether the data starts on a 2 MiB boundary of a mapping of its own."""
        return self._mapping is not None

    def __del__(self) -> None:
        mapping, self._mapping = self._mapping, None
        if mapping is None:
            return
        data, self.data = self.data, None
        # the pinned count (which includes the reference this held, now the local) and
        # getrefcount's argument: nothing else refers to the bytes
        if sys.getrefcount(data) == _PINNED_REFCOUNT + 1:
            del data
            mapping.close()
        else:
            _KEPT_MAPPINGS.append(mapping)


def read_program_bytes(path: Path) -> ProgramBytes:
    """``path``'s bytes, on a 2 MiB boundary in huge pages where this interpreter allows (see
    the module's docstring), else as ``read_bytes`` gives them, asked into huge pages."""
    if not _layout_is_known():
        data = path.read_bytes()
        in_huge_pages(data)
        return ProgramBytes(data)
    size = path.stat().st_size
    header = _BYTES_HEADER.size
    # room for the header before the first 2 MiB boundary and for the trailing NUL after
    mapping = mmap.mmap(-1, size + header + 1 + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    start = (base + header + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    if size >= _HUGE_PAGE:  # below, the 2 MiB boundary only aligns; the pages stay small
        _madvise(start, (size + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1), _MADV_HUGEPAGE)
    offset, done = start - base, 0
    with open(path, "rb") as f, memoryview(mapping) as memory:
        while done < size:
            with memory[offset + done : offset + size] as rest:
                got = f.readinto(rest)
            if not got:
                break
            done += got
        memory[offset - header : offset] = _BYTES_HEADER.pack(_PINNED_REFCOUNT - 1, id(bytes), size, -1)
        # the byte after the data is the NUL every bytes object ends in: the mapping is zeroed
    if done < size:
        mapping.close()
        raise OSError(f"{path} ended after {done} of {size} bytes while being read")
    data = ctypes.cast(start - header, ctypes.py_object).value  # a new reference: the count is pinned
    return ProgramBytes(data, mapping)
