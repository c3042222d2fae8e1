"""``docs/report.png`` is the demo's leaderboard, not a stale one (``make docs-report`` regenerates it).

``docs/report.json`` (written with the picture by :mod:`tools.docs_report`) holds the picture's
``sha256`` and the numbers it shows. Fast: the committed picture is the one the record describes,
and the record's demo GPT was trained for the demo's iterations. Slow: a fresh demo shows exactly
the recorded numbers (run ``make docs-report`` when the demo changes them)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

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
def test_a_fresh_demo_shows_the_recorded_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert (
        demo.main(["--out", str(tmp_path / "demo"), "--no-harness"]) == 0
    )  # the harness is not in the report
    board = json.loads((tmp_path / "demo" / "report" / "leaderboard.json").read_text(encoding="utf-8"))
    assert shown_numbers(board) == RECORD["rows"], "the demo's numbers changed: run `make docs-report`"
