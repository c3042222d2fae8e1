"""The leaderboard page in a real browser (headless Chromium) at a laptop width of 1400 px.

The demo's results plus a dozen realistic ones and the paper's rows: the page must not overflow
horizontally, the table must not be cut off (no horizontal scrolling inside its box either), and
every plot image must be decoded. Skipped with a reason when no Chromium is installed
(``apt-get install chromium``); ``tests/test_report_html.py`` checks the same page without a browser.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from mlm_eval.cli import main as eval_main
from tests import report_fixtures as rf
from tests.test_report_html import png_size
from tools.docs_report import chromium, find_chromium

WIDTH, HEIGHT = 1400, 900
# Appended to a copy of the page: measures the layout after load and writes it into the DOM.
PROBE = """<script>
window.addEventListener("load", function () {
  const box = document.querySelector("div.scroll"), table = document.getElementById("leaderboard");
  const out = {
    viewport: window.innerWidth,
    pageWidth: document.documentElement.scrollWidth,
    boxWidth: box.clientWidth,
    tableWidth: table.scrollWidth,
    images: Array.from(document.images).map(function (i) {
      return {complete: i.complete, width: i.naturalWidth, shown: i.getBoundingClientRect().width};
    }),
  };
  // Interactions: sort by parameters (largest first), then filter to "bert" and hide references.
  const body = table.tBodies[0];
  table.querySelector('th[data-col="2"]').click();
  out.byParams = Array.from(body.rows).slice(0, 2).map(function (r) {
    return r.cells[1].querySelector(".name").textContent;
  });
  const filter = document.getElementById("filter");
  filter.value = "bert";
  filter.dispatchEvent(new Event("input"));
  const refs = document.getElementById("show-refs");
  refs.checked = false;
  refs.dispatchEvent(new Event("change"));
  out.filtered = Array.from(body.rows).filter(function (r) { return !r.hidden; })
    .map(function (r) { return r.cells[1].querySelector(".name").textContent; });
  out.headerSticky = getComputedStyle(table.tHead.rows[2].cells[0]).position;
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


CHROMIUM = find_chromium()
pytestmark = [
    pytest.mark.slow,  # starts a browser
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium at /usr/bin/chromium or on PATH"),
]


def _browser(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return chromium(list(args), profile=tmp_path / "chromium-profile", width=WIDTH, height=HEIGHT)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("report")
    rf.write_demo(root / "results")
    rf.write_realistic(root / "results")
    out = root / "out"
    assert eval_main(["report", "--results", str(root / "results"), "--out", str(out), "--with-paper"]) == 0
    return out / "leaderboard.html"


def test_nothing_overflows_at_1400px_and_every_plot_is_shown(page: Path, tmp_path: Path) -> None:
    probed = tmp_path / "probed.html"
    probed.write_text(page.read_text().replace("</body>", PROBE + "\n</body>"))
    proc = _browser(tmp_path, "--virtual-time-budget=5000", "--dump-dom", probed.as_uri())
    match = re.search(r'<pre id="probe">(.*?)</pre>', proc.stdout)
    assert proc.returncode == 0 and match, proc.stderr[-2000:]
    layout = json.loads(match.group(1).replace("&quot;", '"'))
    assert layout["viewport"] == WIDTH
    assert layout["pageWidth"] <= WIDTH, layout  # no horizontal scrollbar on the page
    assert layout["tableWidth"] <= layout["boxWidth"], layout  # the table is not cut off in its box
    assert len(layout["images"]) == 2
    for image in layout["images"]:  # decoded, and shown no wider than the page
        assert image["complete"] and image["width"] > 600 and 0 < image["shown"] <= WIDTH, image
    # The inline script sorts (a click on Params: largest first) and filters (runs named *bert*).
    assert layout["byParams"] == ["Megatron GPT-2 8.3B", "Megatron BERT 3.9B"], layout
    assert layout["filtered"] == ["bert-336m", "ckpt_bert"] and layout["headerSticky"] == "sticky", layout


def test_screenshot_at_laptop_width_shows_the_table(page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    proc = _browser(tmp_path, f"--screenshot={shot}", page.as_uri())
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    assert png_size(shot.read_bytes()) == (WIDTH, HEIGHT)
    pixels = imread(shot)[..., :3]
    # A blank page is one colour; the table, its shaded cells and the text give many.
    assert pixels.std() > 0.05
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50
    # Text reaches the right part of the table (the last columns are on screen, not cut off).
    right = pixels[150:700, WIDTH - 300 : WIDTH - 40]
    assert (right.mean(axis=2) < 0.4).mean() > 0.002
    # The best cells' green shading is on screen.
    green = (pixels[..., 1] > pixels[..., 0] + 0.03) & (pixels[..., 1] > pixels[..., 2] + 0.03)
    assert green[:HEIGHT].mean() > 0.0005
