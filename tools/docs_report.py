"""``make docs-report``: regenerate ``docs/report.png`` from the demo, with its record ``docs/report.json``.

Runs the demo (:mod:`tools.demo`, its defaults) into a temporary directory, screenshots the demo's
leaderboard page in headless Chromium at :data:`WIDTH` x :data:`HEIGHT`, and writes beside the
picture a small JSON record: the picture's ``sha256`` and the numbers it shows (the run rows of
``leaderboard.json`` as printed: name, rank, parameters, iteration, layouts, each cell's text and
marks). ``tests/test_docs_report.py`` checks that the committed picture is the one its record
describes and that the record's model was trained for the demo's iterations; its slow test runs the
demo afresh and compares the numbers, so the picture cannot drift silently from the demo.

``--demo-dir DIR`` reuses a finished demo's results (only the report step runs again).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pretrain.utils.atomic import atomic_open
from pretrain.utils.errors import UserError, cli_entry

WIDTH, HEIGHT = 1400, 760
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--hide-scrollbars",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
PNG_NAME, RECORD_NAME = "report.png", "report.json"


def find_chromium() -> str | None:
    """Debian's ``/usr/bin/chromium``, else ``chromium`` / ``chromium-browser`` on ``PATH``."""
    if Path("/usr/bin/chromium").exists():
        return "/usr/bin/chromium"
    return shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(
    args: list[str], *, profile: Path, width: int = WIDTH, height: int = HEIGHT
) -> subprocess.CompletedProcess[str]:
    """Run headless Chromium at ``width`` x ``height`` with a throwaway profile."""
    exe = find_chromium()
    if exe is None:
        raise UserError("no chromium at /usr/bin/chromium or on PATH (apt-get install chromium)")
    cmd = [exe, *CHROMIUM_FLAGS, f"--window-size={width},{height}", f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def screenshot(page: Path, png: Path) -> None:
    """``png``: the first :data:`WIDTH` x :data:`HEIGHT` pixels of ``page`` as Chromium shows it."""
    with tempfile.TemporaryDirectory(prefix="mlm-docs-report-") as tmp:
        shot = Path(tmp) / "shot.png"
        proc = chromium([f"--screenshot={shot}", page.resolve().as_uri()], profile=Path(tmp) / "profile")
        if proc.returncode != 0 or not shot.is_file():
            raise UserError(f"chromium could not screenshot {page}: {proc.stderr.strip()[-300:]}")
        with atomic_open(png, "wb") as fh:
            fh.write(shot.read_bytes())


def shown_numbers(leaderboard: dict[str, Any]) -> list[dict[str, Any]]:
    """The run rows of a ``leaderboard.json`` as the page prints them (paper rows are constants)."""
    return [
        {
            "name": row["name"],
            "rank": row["rank"],
            "parameters": row["parameters"],
            "iteration": row["iteration"],
            "formats": row["formats"],
            "cells": {k: {"text": c["text"], "marks": c["marks"]} for k, c in sorted(row["cells"].items())},
        }
        for row in leaderboard["rows"]
        if not row["reference"]
    ]


def record_of(report_dir: Path, png: Path) -> dict[str, Any]:
    """The record written beside the picture (see the module docstring)."""
    board = json.loads((report_dir / "leaderboard.json").read_text(encoding="utf-8"))
    return {
        "picture": PNG_NAME,
        "png_sha256": hashlib.sha256(png.read_bytes()).hexdigest(),
        "size": [WIDTH, HEIGHT],
        "made_by": "make docs-report (python -m tools.docs_report)",
        "rows": shown_numbers(board),
    }


def _demo_report(demo_dir: Path | None, tmp: Path) -> Path:
    """A finished demo's ``report/`` directory: ``demo_dir``'s (report step rerun) or a fresh demo's."""
    from tools import demo

    if demo_dir is None:
        demo_dir = tmp / "demo_out"
        if demo.main(["--out", str(demo_dir)]) != 0:
            raise UserError("the demo failed")
    elif not (demo_dir / "results").is_dir():
        raise UserError(f"--demo-dir {demo_dir}: no results/ (not a finished demo)")
    else:
        demo.run("leaderboard report", demo.report_command(demo_dir.resolve()))
    return demo_dir / "report"


@cli_entry
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("docs"), help="where report.png and report.json go")
    p.add_argument(
        "--demo-dir", type=Path, default=None, help="a finished demo's --out (default: run the demo)"
    )
    args = p.parse_args(argv)
    if find_chromium() is None:  # before minutes of demo
        raise UserError("no chromium at /usr/bin/chromium or on PATH (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="mlm-docs-report-") as tmp:
        report = _demo_report(args.demo_dir, Path(tmp))
        png = args.out / PNG_NAME
        screenshot(report / "leaderboard.html", png)
        with atomic_open(args.out / RECORD_NAME, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(record_of(report, png), indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {png} and {args.out / RECORD_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
