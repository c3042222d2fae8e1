"""Start the disk writeback of a range a writer has just written, while it goes on writing.

Every checkpoint file is fsynced before it is renamed into place (:func:`~pretrain.utils.atomic.atomic_open`,
the ``torch_dist`` writer). Left alone, the kernel starts writing dirty pages back only past
``dirty_background_ratio`` of memory (10%: 2.4 GB on a 24 GB host, so a 2 GB conversion none) or
after 30 s, so that fsync finds every byte still in memory and waits for the disk to take them all
after the work is done: 1.3 s of a 4.4 s 1B reshard (legacy tp2 pp2 -> tp4) here.
``sync_file_range(SYNC_FILE_RANGE_WRITE)`` queues the writeback of the range just written and
returns at once; the disk then writes while the conversion computes, and the final fsync waits only
for the last ranges.

Only for files that are fsynced once complete (the archives :func:`~pretrain.checkpoint.legacy.
stream_save.stream_save` writes: legacy rank files, ``.distcp`` files): a file left to the kernel
(an HF export's safetensors) gains nothing, and its writeback would only take CPU from the
conversion while it runs (1B torch_dist -> HF: about 0.5 s slower with it). Linux only (elsewhere,
and on file systems that refuse it, nothing is done); a hint, never a guarantee: durability still
comes from the fsync that follows. Ranges under :data:`MIN_BYTES` are left to that fsync (one
system call per few KB would cost more than it saves).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

from pretrain.utils.libc import libc

__all__ = ["MIN_BYTES", "start_writeback"]

MIN_BYTES = 1 << 20  # ranges shorter than this are not worth a system call of their own
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages in the range, do not wait


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    fn = getattr(libc(), "sync_file_range", None)  # (None off Linux, or a C library without it)
    if fn is None:
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_SYNC_FILE_RANGE = _libc_sync_file_range()
_ENABLED = os.environ.get("MLM_EARLY_WRITEBACK", "1") != "0"  # 0: leave writeback to the kernel (A/B runs)


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Queue the writeback of bytes ``[offset, offset + nbytes)`` of ``fd`` without waiting for it
    (the call releases the GIL: ctypes); whether it was queued (False: too short, not Linux, or
    refused: the later fsync writes it all the same)."""
    if _SYNC_FILE_RANGE is None or not _ENABLED or nbytes < MIN_BYTES:
        return False
    return _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0
