"""The C library's functions that Python's ``os`` lacks (``madvise`` on a tensor's pages,
``sync_file_range``), found without starting a process.

``ctypes.util.find_library("c")`` runs ``/sbin/ldconfig -p`` in a ``vfork`` child: a few ms per
call, and until that child's ``exec`` it shares this process's memory, so a tool summing the
process tree's memory (``benchmarks/anon_memory.py``) could count this process twice. The
interpreter is linked against the C library already: ``CDLL(None)`` looks its symbols up in the
running program (``dlopen(NULL)``).
"""

from __future__ import annotations

import ctypes
import functools
import sys

__all__ = ["libc"]


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The running program's C library (``errno`` kept for ``ctypes.get_errno``); ``None`` off
    Linux or where it cannot be opened."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
