"""Where a buffer's bytes lie in a memory-mapped file, so the kernel can copy them file to file.

A conversion's output is mostly its input's bytes: a tensor-parallel shard of a column-parallel
weight is one run of a mapped rank file (``torch.load(mmap=True)``) or of a mapped safetensors
file. Written from the mapping (``pwritev``), each page is first faulted into this process and
then copied into the output's page cache; ``copy_file_range`` copies it file to file in the
kernel, as ``cp`` does. For the 2 GB of a 1B checkpoint's rank files, with their CRC-32 read from
the mapping either way: 2.6-3.1 CPU s through the mapping against 1.2 CPU s file to file
(:func:`source_of` is asked by :func:`~pretrain.utils.gathered_write.write_gathered`).

Only where it is exact. The bytes written must be the bytes in memory:

* the buffer must lie within one file mapping of this process, as ``/proc/self/maps`` reads when
  asked (the caller's view keeps that mapping in place meanwhile). Only "not a file" answers are
  taken from an earlier read (writing from memory is always exact): a file answer from an earlier
  read could name a mapping since replaced by one of the same file at another offset at the same
  addresses, which the kernel readily hands out again;
* a private mapping (``torch.load(mmap=True)`` maps ``MAP_PRIVATE``) whose page was written holds
  its own copy there, no longer the file's: ``/proc/self/pagemap`` tells, per page, whether it is
  the file's (present and file-backed, or never brought in and not swapped). Any other page, and
  the buffer is written from memory as before.

Linux only; ``MLM_COPY_FILE_RANGE=0`` turns it off (the writes then go through memory as before).
"""

from __future__ import annotations

import bisect
import mmap
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

__all__ = ["MIN_BYTES", "disable_copy", "source_of"]

MIN_BYTES = 1 << 20  # shorter buffers are written from memory (a fresh read of the maps, ~0.5 ms, costs more)
_MAX_FDS = 64  # source files kept open (least recently used closed first)
_PRESENT, _SWAPPED, _FILE_PAGE = 1 << 63, 1 << 62, 1 << 61  # /proc/PID/pagemap entry bits


@dataclass(frozen=True)
class _Mapping:
    """One line of ``/proc/self/maps``: ``[start, end)`` maps ``path`` from byte ``offset`` (``inode`` 0:
    not a file)."""

    start: int
    end: int
    offset: int
    dev: tuple[int, int]
    inode: int
    path: str


def _parse_line(line: str) -> _Mapping:
    fields = line.split(maxsplit=5)
    lo, _, hi = fields[0].partition("-")
    major, _, minor = fields[3].partition(":")
    path = fields[5] if len(fields) == 6 else ""
    return _Mapping(int(lo, 16), int(hi, 16), int(fields[2], 16), (int(major, 16), int(minor, 16)),
                    int(fields[4]), path)  # fmt: skip


def _is_file(m: _Mapping) -> bool:
    """A mapping of a file that still has a name (not anonymous memory, not ``[heap]``, not deleted)."""
    return m.inode != 0 and m.path.startswith("/") and not m.path.endswith(" (deleted)")


class _MappedFiles:
    """This process's mappings as last read, the source files opened so far, ``/proc/self/pagemap``
    (all used under one lock: the writer threads ask at once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._text = ""
        self._lines: list[str] = []
        self._starts: list[int] = []
        self._fds: OrderedDict[tuple[tuple[int, int], int], int] = OrderedDict()
        self._pagemap: int | None = None
        self.enabled = (
            sys.platform.startswith("linux")
            and hasattr(os, "copy_file_range")
            and (os.environ.get("MLM_COPY_FILE_RANGE", "1") != "0")
        )

    def source_of(self, view: memoryview) -> tuple[int, int] | None:
        if not self.enabled or len(view) < MIN_BYTES:
            return None
        try:
            addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
        except (ValueError, TypeError, BufferError):  # not one contiguous run of bytes
            return None
        with self._lock:
            found = self._file_mapping(addr, len(view))
            if found is None or not self._file_pages(addr, len(view)):
                return None
            fd = self._fd(found)
        return None if fd is None else (fd, found.offset + addr - found.start)

    def _file_mapping(self, addr: int, n: int) -> _Mapping | None:
        """The file mapping holding ``[addr, addr + n)`` now, or None: from the last read when that
        says "not a file", else from a fresh one (module docstring)."""
        last = self._lookup(addr, n)
        if last is not None and not _is_file(last):
            return None
        self._reread()
        now = self._lookup(addr, n)
        return now if now is not None and _is_file(now) else None

    def _lookup(self, addr: int, n: int) -> _Mapping | None:
        """The mapping of the last read holding all of ``[addr, addr + n)`` (the hit line parsed)."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        m = _parse_line(self._lines[i])
        return m if addr + n <= m.end else None

    def _reread(self) -> None:
        """``/proc/self/maps`` now (lines in address order; only their start addresses parsed), and
        the kept descriptors of files no longer mapped closed (a deleted source's space let go)."""
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as f:
                text = f.read()
        except OSError:
            text = ""
        if text == self._text:  # unchanged since the last read (the usual case): nothing to parse
            return
        self._text = text
        self._lines = [line for line in text.splitlines() if line]
        self._starts = [int(line[: line.index("-")], 16) for line in self._lines]
        for key in [k for k in self._fds if f" {k[1]} " not in text]:  # (a false match keeps it open)
            os.close(self._fds.pop(key))

    def _file_pages(self, addr: int, n: int) -> bool:
        """Whether every page of ``[addr, addr + n)`` holds the file's bytes: not a private copy
        (present and not file-backed), not swapped out."""
        if self._pagemap is None:
            try:
                self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self.enabled = False
                return False
        first, last = addr // mmap.PAGESIZE, (addr + n - 1) // mmap.PAGESIZE
        want = (last - first + 1) * 8
        raw = os.pread(self._pagemap, want, first * 8)
        if len(raw) != want:
            return False
        entries = np.frombuffer(raw, dtype="<u8")
        private = (entries & _PRESENT != 0) & (entries & _FILE_PAGE == 0)
        return not bool((private | (entries & _SWAPPED != 0)).any())

    def _fd(self, m: _Mapping) -> int | None:
        """A read-only descriptor of ``m``'s file (checked to be the mapped one), kept open."""
        key = (m.dev, m.inode)
        fd = self._fds.get(key)
        if fd is not None:
            self._fds.move_to_end(key)
            return fd
        try:
            fd = os.open(m.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        st = os.fstat(fd)
        if st.st_ino != m.inode or (os.major(st.st_dev), os.minor(st.st_dev)) != m.dev:
            os.close(fd)  # the name now holds another file
            return None
        self._fds[key] = fd
        while len(self._fds) > _MAX_FDS:
            os.close(self._fds.popitem(last=False)[1])
        return fd


_FILES = _MappedFiles()


def source_of(view: memoryview) -> tuple[int, int] | None:
    """``(fd, offset)``: ``view``'s bytes are that file's from ``offset`` on, and may be copied from
    it (module docstring); None where they must be written from memory (anonymous memory, a page
    written since it was mapped, shorter than :data:`MIN_BYTES`, turned off, not Linux). The
    descriptor stays open and owned here: do not close it."""
    return _FILES.source_of(view)


def disable_copy() -> None:
    """Write everything from memory from now on (``copy_file_range`` refused by this kernel or file
    system: ``EXDEV``, ``EINVAL``, ``ENOSYS``, ``EOPNOTSUPP``)."""
    _FILES.enabled = False
