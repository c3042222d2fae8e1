"""The leaderboard HTML page without a browser: parsed, checked for the table, marks and plots."""

from __future__ import annotations

import base64
import struct
from html.parser import HTMLParser
from pathlib import Path

from mlm_eval.cli import main as eval_main
from mlm_eval.report_table import MISSING
from tests.test_report import results_dir as results_dir  # noqa: F401  (pytest fixture)


class _PageParser(HTMLParser):
    """Collects the leaderboard table's cells (by row) and the images' src attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.row_classes: list[str] = []
        self.images: list[str] = []
        self.bold: list[str] = []
        self._in_table = self._in_cell = self._in_bold = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table" and a.get("id") == "leaderboard":
            self._in_table = True
        elif self._in_table and tag == "tr":
            self.rows.append([])
            self.row_classes.append(a.get("class") or "")
        elif self._in_table and tag in ("td", "th"):
            self._in_cell = True
            self.rows[-1].append("")
        elif tag == "strong":
            self._in_bold = True
        elif tag == "img":
            self.images.append(a.get("src") or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in_table = False
        elif tag in ("td", "th"):
            self._in_cell = False
        elif tag == "strong":
            self._in_bold = False

    def handle_data(self, data: str) -> None:
        if self._in_cell:
            self.rows[-1][-1] += data
            if self._in_bold:
                self.bold.append(data)


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (asserts the signature)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_html_is_self_contained_with_table_and_embedded_plots(results_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    eval_main(["report", "--results", str(results_dir), "--out", str(out), "--with-paper"])
    page = (out / "leaderboard.html").read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page
    parser = _PageParser()
    parser.feed(page)
    header, *body = parser.rows
    assert header[:6] == ["#", "Model", "Params", "Iteration", "Layout", "WikiText-103 adj. ppl ↓"]
    first = body[0]
    assert first[:6] == ["1", "gpt-b", "350M", "2000", "tp1-pp1-vp1", "20.00"]
    assert first[header.index("LAMBADA acc % ↑")] == MISSING
    assert "20.00" in parser.bold and "45.50" in parser.bold and "10.81" not in parser.bold
    ref_rows = [r for r, cls in zip(parser.rows, parser.row_classes, strict=True) if cls == "reference"]
    assert len(ref_rows) == 8 and all(r[0] == "ref" for r in ref_rows)
    assert len(parser.images) == 2
    for src in parser.images:
        assert src.startswith("data:image/png;base64,")
        width, height = png_size(base64.b64decode(src.split(",", 1)[1]))
        assert width > 300 and height > 200
