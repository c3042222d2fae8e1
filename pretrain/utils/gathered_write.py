"""Writing byte chunks that lie apart in memory as one run of a file, without joining them first.

A file writer that has a tensor as pieces (a tensor-parallel shard's rows, the rows of a column
range of a mapped checkpoint block) hands the kernel the list: ``os.writev`` / ``os.pwritev`` take
up to ``IOV_MAX`` buffers a call, so a thousand gathered rows cost one system call and no copy in
this process. Short writes (a signal, a call over 2 GiB) are completed in order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["write_gathered"]

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16


def write_gathered(fd: int, chunks: Sequence[memoryview], offset: int | None = None) -> None:
    """Write the 1-D byte ``chunks`` in order to ``fd``: at its position (``offset`` None) or from
    byte ``offset`` on (the file position unchanged)."""
    at = offset if offset is not None else 0
    if not hasattr(os, "pwritev"):  # (not on Windows): one chunk a call
        for chunk in chunks:
            at = _write_from(fd, chunk, offset, at)
        return
    for lo in range(0, len(chunks), _IOV_MAX):
        batch = chunks[lo : lo + _IOV_MAX]
        want = sum(map(len, batch))
        done = os.writev(fd, batch) if offset is None else os.pwritev(fd, batch, at)
        if done < want:  # a short write: the rest of the batch, chunk by chunk
            skip = done
            for chunk in batch:
                if skip >= len(chunk):
                    skip -= len(chunk)
                    continue
                _write_from(fd, chunk[skip:], offset, at + done)
                done += len(chunk) - skip
                skip = 0
        at += want


def _write_from(fd: int, view: memoryview, offset: int | None, at: int) -> int:
    """Write all of ``view`` (at ``at`` when ``offset`` is given); the position after it."""
    while len(view):
        n = os.write(fd, view) if offset is None else os.pwrite(fd, view, at)
        view, at = view[n:], at + n
    return at
