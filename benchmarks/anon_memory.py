"""Peak anonymous memory of a command and every process it starts (``torchrun`` ranks included).

The figure is ``RssAnon`` of ``/proc/PID/status`` summed over the process tree, sampled every
millisecond from outside: pages of memory-mapped input files (the checkpoint being read) are
file-backed, so they do not count; the kernel can reclaim them. Children run with
``MALLOC_MMAP_THRESHOLD_=131072`` so freed tensors go back to the OS at once and RssAnon tracks
live memory, not glibc's cache.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path


def _anon_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
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


def tree_anon_bytes(pid: int) -> int:
    """RssAnon of ``pid`` and all its descendants, in bytes."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += _anon_kb(p)
        todo.extend(_children(p))
    return total * 1024


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
