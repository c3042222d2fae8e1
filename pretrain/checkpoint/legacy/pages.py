"""Give back the resident pages of mmap'd checkpoint tensors once they have been read.

Rank files are opened with ``torch.load(mmap=True)``: every page a reshard touches stays in the
process's resident set (as clean file-backed pages) until the file is unmapped, so reading a
whole model would count the model's size in RSS. :class:`PageReleaser` finds, in
``/proc/self/maps``, the address ranges mapped from the checkpoint files and, for a tensor read
from them, calls ``madvise(MADV_DONTNEED)`` on the whole pages it covers *within those ranges
only*. For an unmodified private file mapping this is transparent: a later access faults the page
back in from the page cache. Anything else (anonymous memory, other platforms) is left alone.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from pretrain.utils.libc import libc

_MADV_DONTNEED = 4  # Linux


class PageReleaser:
    """``release(tensor)`` drops its pages from RSS if they lie in a mapping of ``files``."""

    def __init__(self, files: Iterable[Path]) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.libc = None
        if not sys.platform.startswith("linux"):
            return
        names = {str(Path(f).resolve()) for f in files}
        try:
            lines = Path("/proc/self/maps").read_text().splitlines()
        except OSError:
            return
        self.libc = libc()
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5] in names:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                self.ranges.append((lo, hi))

    def release_all(self) -> None:
        """Drop every resident page of the mapped files (e.g. after building one tensor of many)."""
        if self.libc is None:
            return
        for lo, hi in self.ranges:
            self.libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)

    def release(self, tensor: torch.Tensor) -> None:
        if self.libc is None or not self.ranges or tensor.device.type != "cpu":
            return
        storage = tensor.untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        page = mmap.PAGESIZE
        for lo, hi in self.ranges:
            a = (max(start, lo) + page - 1) // page * page
            b = min(end, hi) // page * page
            if a < b:
                self.libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_DONTNEED)
