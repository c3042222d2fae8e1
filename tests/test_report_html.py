"""The leaderboard HTML page without a browser: parsed, checked for the grouped header, rows, marks,
the inline script and the embedded plots."""

from __future__ import annotations

import base64
import struct
from html.parser import HTMLParser

import pytest

from mlm_eval.cli import main as eval_main
from tests import report_fixtures as rf


class _PageParser(HTMLParser):
    """Collects the leaderboard table's cells (by row, with their classes), images and scripts."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.row_classes: list[str] = []
        self.cell_classes: list[list[str]] = []
        self.images: list[str] = []
        self.bold: list[str] = []
        self.scripts: list[dict[str, str | None]] = []
        self.links: list[str] = []
        self._in_table = self._in_cell = self._in_bold = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table" and a.get("id") == "leaderboard":
            self._in_table = True
        elif self._in_table and tag == "tr":
            self.rows.append([])
            self.cell_classes.append([])
            self.row_classes.append(a.get("class") or "")
        elif self._in_table and tag in ("td", "th"):
            self._in_cell = True
            self.rows[-1].append("")
            self.cell_classes[-1].append(a.get("class") or "")
        elif self._in_cell and tag == "span" and self.rows[-1][-1]:
            self.rows[-1][-1] += " | "  # name | details, value | mark
        elif tag == "strong":
            self._in_bold = True
        elif tag == "img":
            self.images.append(a.get("src") or "")
        elif tag == "script":
            self.scripts.append(a)
        elif tag == "link":
            self.links.append(a.get("href") or "")

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


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("html")
    rf.write_demo(root / "results")
    rf.write_realistic(root / "results")
    assert (
        eval_main(["report", "--results", str(root / "results"), "--out", str(root / "out"), "--with-paper"])
        == 0
    )
    return (root / "out" / "leaderboard.html").read_text()


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
def test_page_is_self_contained(page: str) -> None:
    parser = _PageParser()
    parser.feed(page)
    assert "http://" not in page and "https://" not in page and not parser.links
    assert parser.scripts == [{}]  # one inline script (sorting, filtering), nothing loaded
    assert 'id="filter"' in page and 'id="show-refs"' in page and "position: sticky" in page
    assert len(parser.images) == 2
    for src in parser.images:
        assert src.startswith("data:image/png;base64,")
        width, height = png_size(base64.b64decode(src.split(",", 1)[1]))
        assert width > 600 and height > 300


def test_grouped_header_rows_marks_and_best(page: str) -> None:
    parser = _PageParser()
    parser.feed(page)
    families, tasks, metrics, *body = parser.rows
    assert families[:3] == ["#", "Model", "Params"]
    assert families[3:] == ["Zero-shot LM", "GLUE", "SQuAD", "Data hygiene"]
    assert tasks[:3] == ["WikiText-103", "WikiText-103 [harness]", "LAMBADA"]
    assert metrics[:2] == ["adj. ppl ↓", "token ppl ↓"] and "acc % ↑" in metrics
    runs = [r for r, cls in zip(body, parser.row_classes[3:], strict=True) if cls != "reference"]
    refs = [r for r, cls in zip(body, parser.row_classes[3:], strict=True) if cls == "reference"]
    assert len(runs) == 8 and len(refs) == 8 and all(r[0] == "ref" for r in refs)
    first = runs[0]
    assert first[:3] == ["1", "gpt-1.3b | w1:d4d4d4d4d4d4; iter 300000; tp4-pp2-vp1", "1.32B"]
    assert first[3] == "15.72 | bf16"
    demo = next(r for r in runs if r[1].startswith("demo-gpt"))
    assert "HF, tp1-pp1-vp1, tp2-pp2-vp1" in demo[1] and demo[3] == "2.171e7 | sample data"
    g345 = next(r for r in runs if r[1].startswith("gpt-345m | w1:b2"))
    lambada_acc = 3 + metrics.index("acc % ↑")
    assert g345[lambada_acc] == "44.32 | contaminated 0.83%"
    g760 = next(r for r in runs if r[1].startswith("gpt-760m"))
    assert g760[0] == "—" and g760[lambada_acc] == "54.00 | partial n=100"
    assert sorted(parser.bold) == ["15.72", "58.12", "6.020"]  # gpt-1.3b: the only meaningful bests
