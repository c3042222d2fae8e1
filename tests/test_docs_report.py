"""``docs/report.png`` is the demo's leaderboard, not a stale one (``make docs-report`` regenerates it).

``docs/report.json`` (written with the picture by :mod:`tools.docs_report`) holds the picture's
``sha256`` and the numbers it shows. Fast: the committed picture is the one the record describes,
and the record's demo GPT was trained for the demo's iterations. Slow: a fresh demo shows the
recorded rows, sizes, iterations and marks exactly and the recorded numbers within 5% (hosts differ
in their last float digits -- another CPU's kernels round differently over 200 training steps -- while
a changed demo moves them by far more; run ``make docs-report`` when the demo changes them)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from tests.fresh_demo import FreshDemo
from tests.test_report_html import png_size
from tools import demo
from tools.docs_report import HEIGHT, PNG_NAME, RECORD_NAME, WIDTH, shown_numbers

DOCS = Path(__file__).resolve().parents[1] / "docs"
RECORD = json.loads((DOCS / RECORD_NAME).read_text(encoding="utf-8"))


def test_the_picture_is_the_recorded_one() -> None:
    png = (DOCS / PNG_NAME).read_bytes()
    assert hashlib.sha256(png).hexdigest() == RECORD["png_sha256"], "run `make docs-report`"
    assert png_size(png) == (WIDTH, HEIGHT) == tuple(RECORD["size"])


def test_the_recorded_demo_model_is_the_demos() -> None:
    (gpt,) = [r for r in RECORD["rows"] if r["name"] == "demo-gpt"]
    assert gpt["iteration"] == demo.build_parser().get_default("train_iters"), "run `make docs-report`"


@pytest.mark.slow
def test_a_fresh_demo_shows_the_recorded_numbers(fresh_demo: FreshDemo) -> None:
    assert fresh_demo.returncode == 0, fresh_demo.log[-3000:]
    board = json.loads((fresh_demo.out / "report" / "leaderboard.json").read_text(encoding="utf-8"))
    fresh, fresh_numbers = _numbers_apart(shown_numbers(board))
    recorded, recorded_numbers = _numbers_apart(RECORD["rows"])
    assert fresh == recorded, "the demo's rows changed: run `make docs-report`"
    assert fresh_numbers == pytest.approx(recorded_numbers, rel=0.05, abs=0.02), (
        "the demo's numbers changed: run `make docs-report`"
    )


def _numbers_apart(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[float]]:
    """``rows`` with each cell's printed number replaced by ``"#"``, and those numbers in order."""
    numbers: list[float] = []

    def cell(c: dict[str, Any]) -> dict[str, Any]:
        try:
            numbers.append(float(c["text"]))
        except ValueError:
            return c
        return {**c, "text": "#"}

    return [{**r, "cells": {k: cell(c) for k, c in sorted(r["cells"].items())}} for r in rows], numbers
