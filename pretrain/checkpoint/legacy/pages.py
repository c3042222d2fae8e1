"""Give back the resident pages of mmap'd checkpoint tensors once they have been read.

Rank files are opened with ``torch.load(mmap=True)``: every page a reshard touches stays in the
process's resident set (as clean file-backed pages) until the file is unmapped, so reading a
whole model would count the model's size in RSS. :class:`PageReleaser` finds, in
``/proc/self/maps``, the address ranges mapped from the checkpoint files and, for a tensor read
from them, calls ``madvise(MADV_DONTNEED)`` on the whole pages it covers *within those ranges
only*. For an unmodified private file mapping this is transparent: a later access faults the page
back in from the page cache. Anything else (anonymous memory, other platforms) is left alone.

A private mapping whose pages were written is not unmodified: ``MADV_DONTNEED`` throws the
written copies away, and the next read sees the file again. Another library in this process may
map the same file and write to it (transformers maps ``model.safetensors``, and PEFT's PiSSA or
OLoRA initialisation then rewrites the base weights in place), so a reader gives back pages of
its own mappings only: ``skip`` names the ranges that were mapped before it opened the files
(:func:`mapped_ranges`), and :meth:`PageReleaser.release_all` leaves them alone.
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


Range = tuple[int, int]  # [start, end) addresses of one mapping


def mapped_ranges(files: Iterable[Path]) -> list[Range] | None:
    """The address ranges of this process that map ``files`` now (``/proc/self/maps``); None off
    Linux or where the table cannot be read."""
    if not sys.platform.startswith("linux"):
        return None
    names = {str(Path(f).resolve()) for f in files}
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    ranges: list[Range] = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] in names:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            ranges.append((lo, hi))
    return ranges


class PageReleaser:
    """``release(tensor)`` drops its pages from RSS if they lie in a mapping of ``files``;
    ``release_all()`` every page of those mappings, except the ranges in ``skip`` (mapped before
    this reader opened the files: someone else's, which may hold written pages)."""

    def __init__(self, files: Iterable[Path], *, skip: Iterable[Range] = ()) -> None:
        ranges = mapped_ranges(files)
        others = set(skip)
        self.ranges: list[Range] = [] if ranges is None else [r for r in ranges if r not in others]
        self.libc = None if ranges is None else libc()

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
