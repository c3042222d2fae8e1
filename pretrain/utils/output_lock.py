"""One writer per output directory: an exclusive lock held from the output check to the end of the command.

Two runs given the same ``--save`` would each build their own temporary sibling and rename it into
place; the later rename silently wins and both print "wrote". Instead the first run holds
``flock(LOCK_EX)`` on a lock file beside the output, ``.NAME.lock`` in its parent directory (the
output itself is created, or replaced, only at the end), with its pid inside; a second run is
refused at once with one line naming that pid.

The kernel drops a ``flock`` when its process ends however it ends (``kill -9`` and crashes
included), so a dead run never leaves its output locked. The lock file is removed when the command
ends (``cli_entry``) or the interpreter exits; one left by a killed run is stale, holds no lock,
and is simply locked again by the next run. Under ``torchrun`` only global rank 0 locks: the other
ranks are the same run.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
from pathlib import Path

from pretrain.utils.errors import UserError, at_command_end

_held: dict[Path, tuple[int, list[Path]]] = {}  # lock file -> (open descriptor, folders it created)
INSIDE = ".writer.lock"  # the lock file inside an existing output whose parent is not writable


class _HeldElsewhere(Exception):
    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder  # its pid as written in the lock file ("unknown" while being written)


def lock_file_for(path: str | os.PathLike[str]) -> Path:
    """The lock file of output ``path``: ``.NAME.lock`` beside it (symbolic links resolved, so two
    spellings of one directory share one lock), or ``NAME/.writer.lock`` for an existing directory
    in a folder this user cannot write (a ``--save $HOME``)."""
    real = Path(os.path.realpath(path))
    if real.is_dir() and real.parent.is_dir() and not os.access(real.parent, os.W_OK | os.X_OK):
        return real / INSIDE
    return real.parent / f".{real.name or 'root'}.lock"


def lock_output(path: str | os.PathLike[str], *, flag: str) -> None:
    """Hold the exclusive lock of output directory ``path`` until the command ends.

    Raises :class:`UserError` (``FLAG PATH: another process is writing it (pid N)``) when another
    process holds it. Taking it again in the same process is a no-op.
    """
    if os.environ.get("RANK", "0") != "0":
        return
    lock = lock_file_for(path)
    if lock in _held:
        return
    created = [d for d in (lock.parent, *lock.parent.parents) if not d.exists()]  # deepest first
    try:
        fd = _acquire(lock)
    except _HeldElsewhere as exc:
        _remove_empty(created)
        raise UserError(f"{flag} {path}: another process is writing it (pid {exc.holder})") from None
    except OSError as exc:
        _remove_empty(created)
        raise UserError(f"{flag} {path}: cannot create the lock file {lock} ({exc.strerror})") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[lock] = (fd, created)
    at_command_end(release_output_locks)


def release_output_locks() -> None:
    """Remove and unlock every output lock this process holds, and the folders taking it created if
    they are still empty (the run failed). The file goes before its lock: a process waiting on it
    then finds it unlinked and locks a fresh file."""
    for lock, (fd, created) in list(_held.items()):
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)
        _remove_empty(created)
    _held.clear()


def _acquire(lock: Path) -> int:
    """The open, locked descriptor of ``lock``; :class:`_HeldElsewhere` when another process holds it."""
    while True:
        lock.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except FileNotFoundError:  # a failed run removed the folder it had created: make it again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise _HeldElsewhere(holder) from None
        if _still_linked(lock, fd):
            return fd
        os.close(fd)  # its holder removed the file between our open and our lock: take the new one


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first; stops at the first one that is not empty
        try:
            folder.rmdir()
        except OSError:
            return


def _still_linked(lock: Path, fd: int) -> bool:
    try:
        on_disk, ours = os.stat(lock), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (on_disk.st_dev, on_disk.st_ino) == (ours.st_dev, ours.st_ino)


def _read_pid(fd: int) -> str:
    text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    return text if text.isdigit() else "unknown"


atexit.register(release_output_locks)
