"""Atomic file writes: write to a temporary file in the same directory, fsync, then rename.

The results follow the user's umask like any other tool's output (``mkstemp``/``mkdtemp`` alone
would make every file 0600 and every folder 0700, unreadable for teammates and serving accounts).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def current_umask() -> int:
    """The process umask (read by setting and restoring it; call from one thread at a time)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", **kwargs) -> Iterator[IO]:  # type: ignore[type-arg]
    """Open a temporary sibling of ``path``; on success it replaces ``path`` atomically.

    On any exception the temporary file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~current_umask())
    try:
        with open(tmp, mode, **kwargs) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; on success it is renamed to ``path``.

    An existing ``path`` is replaced only after the new directory is complete.
    """
    path = Path(path)
    tmp = temporary_directory_for(path)
    try:
        yield tmp
        replace_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def temporary_directory_for(path: Path) -> Path:
    """A new empty directory beside ``path`` (``.NAME.XXXX.tmp``, following the umask)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~current_umask())
    return tmp


def replace_directory(tmp: Path, path: Path) -> None:
    """Rename the complete directory ``tmp`` to ``path``; an existing ``path`` is replaced only now."""
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
