"""One run of ``make demo``'s steps for the tests that check what it shows (the ``fresh_demo``
session fixture in ``conftest.py``)."""

from __future__ import annotations

import contextlib
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
