"""Peak anonymous memory of a command and every process it starts (``torchrun`` ranks included).

The figure is anonymous resident memory summed over the process tree (see
:func:`tree_anon_bytes`), sampled every millisecond from outside: pages of memory-mapped input files (the checkpoint being read) are
file-backed, so they do not count; the kernel can reclaim them. Children run with
``MALLOC_MMAP_THRESHOLD_=131072`` so freed tensors go back to the OS at once and RssAnon tracks
live memory, not glibc's cache.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pretrain.utils.libc import libc


def _field_kb(path: str, field: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:  # the process ended between listing and reading
        pass
    return 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            text = (task / "children").read_text().split()
            out.extend(int(c) for c in text)
    except OSError:
        pass
    return out


_KCMP_VM = 1  # <linux/kcmp.h>
_SYS_KCMP = {"x86_64": 312, "aarch64": 272}.get(platform.machine())


def _same_memory(a: int, b: int) -> bool | None:
    """Whether processes ``a`` and ``b`` share one address space (``kcmp(KCMP_VM)``): a ``vfork``
    child before its ``exec``, or a ``clone(CLONE_VM)`` one. ``None`` where the kernel will not
    tell (no ``kcmp``; a container's seccomp filter refusing it), ``False`` for a process gone."""
    lib = libc()
    if _SYS_KCMP is None or lib is None:
        return None
    order = lib.syscall(_SYS_KCMP, a, b, _KCMP_VM, 0, 0)  # 0 the same, 1 or 2 an ordering, -1 an error
    if order >= 0:
        return order == 0
    return False if ctypes.get_errno() == errno.ESRCH else None


_PF_FORKNOEXEC = 0x40  # <linux/sched.h>: forked, not yet exec'd


def _looks_borrowed(pid: int) -> bool:
    """Without ``kcmp``: a child not yet ``exec``'d none of whose anonymous pages is shared
    (``Pss_Anon`` = ``Anonymous``). A ``fork`` child shares its parent's pages until either writes
    them; a ``vfork`` child maps the parent's pages once, in the parent's own address space."""
    try:
        flags = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[6])
    except (OSError, ValueError, IndexError):
        return False
    if not flags & _PF_FORKNOEXEC:
        return False
    rollup = f"/proc/{pid}/smaps_rollup"
    rss = _field_kb(rollup, "Anonymous:")
    return rss > 0 and _field_kb(rollup, "Pss_Anon:") == rss


def _one_per_address_space(tree: list[int]) -> list[int]:
    """``tree`` (its root first) without the processes that share an earlier one's memory:
    ``smaps_rollup`` of a ``vfork`` child reports its parent's whole address space, unshared
    (``Pss`` = ``Rss``), so counting both counts the parent twice (``subprocess`` starts children
    with ``vfork``, and under load the child may wait for a CPU between ``vfork`` and ``exec`` for
    many samples)."""
    kept = tree[:1]
    for p in tree[1:]:
        same = [_same_memory(k, p) for k in kept]
        if True in same or (None in same and _looks_borrowed(p)):
            continue
        kept.append(p)
    return kept


def tree_anon_bytes(pid: int) -> int:
    """Anonymous memory of ``pid`` and all its descendants, in bytes: ``RssAnon`` of a lone
    process; with children, each process's ``Pss_Anon`` (its share of anonymous pages), because a
    forked child (``tools/forked_job.py``) shares its parent's pages copy-on-write and ``RssAnon``
    would count them twice (torchrun's workers are fresh interpreters). Processes sharing one
    address space (a ``vfork`` child before its ``exec``) count once."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(_children(p))
    tree = _one_per_address_space(tree)
    if len(tree) == 1:
        return _field_kb(f"/proc/{tree[0]}/status", "RssAnon:") * 1024
    return sum(_field_kb(f"/proc/{p}/smaps_rollup", "Pss_Anon:") for p in tree) * 1024


@dataclass(frozen=True, kw_only=True)
class Measured:
    """A finished command: exit code, wall seconds, peak tree RssAnon (bytes), output tail."""

    returncode: int
    wall_s: float
    peak_anon_bytes: int
    output: str


def run_measured(cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
                 interval: float = 0.001) -> Measured:  # fmt: skip
    """Run ``cmd`` to completion while sampling its process tree's RssAnon."""
    full_env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", **(env or {})}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=full_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_anon_bytes(proc.pid))
            time.sleep(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out, _ = proc.communicate()
    wall = time.perf_counter() - start
    done.set()
    thread.join()
    return Measured(returncode=proc.returncode, wall_s=wall, peak_anon_bytes=peak[0], output=out)
