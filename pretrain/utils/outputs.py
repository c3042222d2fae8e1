"""Output locations checked before any work starts: one line naming the flag, exit 2.

A run that would fail only at its first write (a read-only ``--save`` after hours of training, a
``--out`` that is a directory) is refused up front. The check is a real probe: the nearest
existing directory on the way to the output gets a temporary file created and removed, so it is
right for every user (``root`` included) and file system (read-only mounts, quotas aside). An
output directory is also locked against a second writer (:mod:`pretrain.utils.output_lock`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Literal

from pretrain.utils.errors import UserError
from pretrain.utils.output_lock import lock_output

OutputKind = Literal["file", "dir"]


def check_writable_output(
    path: str | os.PathLike[str], *, kind: OutputKind, flag: str, shared: bool = False
) -> Path:
    """Check that ``path`` can be written as a ``kind`` ("file" or "dir"); returns it as a Path.

    A missing path is fine when its nearest existing ancestor is a writable directory (the
    folders are created later). Raises :class:`UserError` naming ``flag`` and the path otherwise.
    An output directory is then locked for this command (:func:`lock_output`: a second process
    writing it is refused) unless ``shared``: a directory that several runs fill with their own
    files, each written atomically (a results directory).
    """
    p = Path(path)
    if p.exists():
        if kind == "file" and p.is_dir():
            raise UserError(f"{flag} {p}: is a directory, expected a file name")
        if kind == "dir" and not p.is_dir():
            raise UserError(f"{flag} {p}: is a file, expected a directory")
    probe_dir = p if kind == "dir" and p.is_dir() else _nearest_existing(p.parent if kind == "file" else p)
    if not probe_dir.is_dir():
        raise UserError(f"{flag} {p}: {probe_dir} is not a directory")
    if not _can_write_in(probe_dir):
        raise UserError(f"{flag} {p}: cannot write in {probe_dir} (permission denied or read-only)")
    if kind == "file" and p.exists() and not os.access(p, os.W_OK):
        raise UserError(f"{flag} {p}: the file is not writable")
    if kind == "dir" and not shared:
        lock_output(p, flag=flag)
    return p


def _nearest_existing(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _can_write_in(directory: Path) -> bool:
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    try:
        fd, probe = tempfile.mkstemp(prefix=".mlm-write-probe.", dir=directory)
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return True
