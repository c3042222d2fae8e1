"""The leaderboard page renders in a real browser (headless Chromium), where one is installed.

Skipped with a reason when no Chromium is found; ``tests/test_report.py`` parses the same page
without a browser and always runs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from mlm_eval.cli import main as eval_main
from tests.test_report import write_fixtures
from tests.test_report_html import png_size

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def _chromium() -> str | None:
    if Path("/usr/bin/chromium").exists():
        return "/usr/bin/chromium"
    return shutil.which("chromium")


CHROMIUM = _chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium at /usr/bin/chromium or on PATH")


def _browser(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    profile = tmp_path / "chromium-profile"
    cmd = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("report")
    write_fixtures(root / "results")
    assert (
        eval_main(["report", "--results", str(root / "results"), "--out", str(root / "out"), "--with-paper"])
        == 0
    )
    return root / "out" / "leaderboard.html"


def test_rendered_dom_has_table_rows_and_images(page: Path, tmp_path: Path) -> None:
    proc = _browser(tmp_path, "--dump-dom", page.as_uri())
    dom = proc.stdout
    assert proc.returncode == 0 and '<table class="leaderboard" id="leaderboard">' in dom, proc.stderr[-2000:]
    # Runs ranked by WikiText-103 adjusted ppl (lower first), references marked, best in bold.
    assert re.search(r"<td class=\"meta\">1</td><td class=\"meta\">gpt-b</td>", dom)
    assert dom.count('<tr class="reference">') == 8
    assert re.search(r'<td class="num best"[^>]*><strong>20\.00</strong></td>', dom)
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', dom)
    assert len(images) == 2


def test_screenshot_is_a_non_blank_png(page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    proc = _browser(tmp_path, f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri())
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    assert png_size(shot.read_bytes()) == (1200, 1600)
    pixels = imread(shot)[..., :3]
    # A blank page is one colour; the table, its shaded cells and the text give many.
    assert pixels.std() > 0.05
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50
    # The top-left region holds the heading and the table: dark text pixels must be present.
    assert (pixels[:400, :900].mean(axis=2) < 0.3).mean() > 0.005
