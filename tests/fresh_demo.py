"""One run of ``make demo``'s steps for the tests that check what it shows (the ``fresh_demo``
session fixture in ``conftest.py``), shared by every pytest-xdist worker of a run.

The first worker to ask runs the demo under a file lock in the run's common base directory; the
others wait on the lock and read its record. (``--dist loadgroup`` cannot keep the tests on one
worker: with pytest 9.2 the ``xdist_group`` mark no longer groups anything, pytest-xdist #1386.)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FreshDemo:
    """``tools.demo.main`` without the harness step (not in the report): its output directory, exit
    code and everything it printed (its commands' output included)."""

    out: Path
    returncode: int
    log: str


def shared_demo(base: Path) -> FreshDemo:
    """The demo of this test run, run once: ``base`` is the run's base temporary directory (under
    pytest-xdist each worker's base is a child of the run's)."""
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    record = root / "fresh_demo.json"
    with open(root / "fresh_demo.lock", "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not record.is_file():
            (root / "fresh_demo").mkdir(exist_ok=True)
            demo = run_demo(root / "fresh_demo")
            record.write_text(json.dumps({"out": str(demo.out), "returncode": demo.returncode}))
        saved = json.loads(record.read_text())
    log = Path(saved["out"]).parent / "demo.log"
    return FreshDemo(
        out=Path(saved["out"]), returncode=saved["returncode"], log=log.read_text(encoding="utf-8")
    )


def run_demo(root: Path) -> FreshDemo:
    """The demo into ``root/demo``. Its commands write to file descriptor 1, so that descriptor, not
    only ``sys.stdout``, goes to ``root/demo.log`` while it runs."""
    from tools import demo

    log = root / "demo.log"
    with open(log, "w", encoding="utf-8") as f, contextlib.redirect_stdout(f):
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            code = demo.main(["--out", str(root / "demo"), "--no-harness"])
        except SystemExit as stop:  # a demo command failed: the tests report it with the log
            code = stop.code if isinstance(stop.code, int) and stop.code else 1
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
    return FreshDemo(out=root / "demo", returncode=code, log=log.read_text(encoding="utf-8"))
