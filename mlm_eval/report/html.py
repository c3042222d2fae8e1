"""The leaderboard as one self-contained HTML page: no network, inline CSS and script, PNG plots
embedded as data URIs.

The table has a two-level sticky header (task family, then task with metric, unit and direction);
clicking a header sorts by it (missing values last), the filter box keeps the rows whose model
text matches, and a checkbox hides the paper's reference rows. Marks sit under the value in each
cell; the tooltip of a cell names its runs, seeds, files and other kept variants.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence

from mlm_eval.report.board import Cell, Leaderboard, Row
from mlm_eval.report.columns import MISSING, Column, format_params
from mlm_eval.report.plots import Plot
from mlm_eval.report.text import ReportMeta, cell_text, details_text, notes, rank_header, rank_text

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em 2em; color: #222; }
h1 { margin-bottom: 0.2em; }
p.meta { color: #555; margin-top: 0; }
div.controls { margin: 0.8em 0; display: flex; gap: 1.5em; align-items: center; font-size: 14px; }
div.controls input[type=search] { width: 22em; padding: 3px 6px; }
div.scroll { overflow: auto; max-height: 80vh; border: 1px solid #ddd; }
table.leaderboard { border-collapse: separate; border-spacing: 0; font-size: 13px; width: 100%; }
table.leaderboard th, table.leaderboard td { border-right: 1px solid #e2e2e2; border-bottom: 1px solid #e2e2e2;
  padding: 3px 6px; }
table.leaderboard thead th { position: sticky; background: #f3f3f3; z-index: 2; font-weight: 600;
  vertical-align: bottom; }
table.leaderboard thead tr.families th { text-align: center; background: #e8ecf2; }
table.leaderboard thead tr.tasks th { text-align: center; }
table.leaderboard thead th.metric { font-weight: normal; font-size: 12px; }
th.sortable { cursor: pointer; }
th.sortable:hover { background: #e4e4e4; }
th.sorted-asc::after { content: " ▲"; font-size: 10px; }
th.sorted-desc::after { content: " ▼"; font-size: 10px; }
td.model { min-width: 13em; max-width: 19em; }
td.model .name { font-weight: 600; }
td.model .details { display: block; color: #666; font-size: 11px; overflow-wrap: anywhere; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.rank { text-align: right; color: #555; }
td.best { background: #dff3df; }
td.missing { color: #aaa; text-align: center; }
span.mark { display: block; font-size: 10px; line-height: 1.25; color: #8a5a00; white-space: normal; }
span.mark.contaminated { color: #b00020; }
span.mark.older { color: #b00020; font-weight: 600; }
th .why { display: block; max-width: 7em; font-size: 10px; font-weight: normal; white-space: normal; }
span.mark.partial, span.mark.sample { color: #6d4c9f; }
tr.reference td { font-style: italic; color: #555; background: #fafaf0; }
tr.reference td.best { background: #fafaf0; }
span.badge { border: 1px solid #aa8; border-radius: 3px; padding: 0 4px; font-size: 11px; font-style: normal; }
ul.notes { font-size: 13px; color: #333; max-width: 75em; }
div.plots figure { margin: 1em 0; }
div.plots img { max-width: 100%; height: auto; border: 1px solid #ddd; }
figcaption { font-size: 13px; color: #444; }
"""

_SCRIPT = """
(function () {
  const table = document.getElementById("leaderboard");
  const body = table.tBodies[0];
  function stick() {  // each header row sticks below the rows above it
    let top = 0;
    Array.from(table.tHead.rows).forEach(function (tr) {
      Array.from(tr.cells).forEach(function (th) { if (th.rowSpan === 1 || top === 0) th.style.top = top + "px"; });
      top += tr.getBoundingClientRect().height;
    });
  }
  stick();
  window.addEventListener("resize", stick);
  let current = null, ascending = true;
  table.querySelectorAll("th.sortable").forEach(function (th) {
    th.addEventListener("click", function () {
      const col = Number(th.dataset.col);
      ascending = current === col ? !ascending : th.dataset.lower !== "false";
      current = col;
      table.querySelectorAll("th.sortable").forEach(function (o) { o.classList.remove("sorted-asc", "sorted-desc"); });
      th.classList.add(ascending ? "sorted-asc" : "sorted-desc");
      const rows = Array.from(body.rows);
      rows.sort(function (a, b) {
        const x = a.cells[col].dataset.v, y = b.cells[col].dataset.v;
        if (x === undefined || x === "") return (y === undefined || y === "") ? 0 : 1;
        if (y === undefined || y === "") return -1;
        const nx = Number(x), ny = Number(y);
        const c = (isNaN(nx) || isNaN(ny)) ? String(x).localeCompare(String(y)) : nx - ny;
        return ascending ? c : -c;
      });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
  const filter = document.getElementById("filter"), refs = document.getElementById("show-refs");
  function apply() {
    const q = filter.value.trim().toLowerCase();
    Array.from(body.rows).forEach(function (r) {
      const hitText = !q || r.cells[1].textContent.toLowerCase().includes(q);
      const hitRef = refs.checked || !r.classList.contains("reference");
      r.hidden = !(hitText && hitRef);
    });
  }
  filter.addEventListener("input", apply);
  refs.addEventListener("change", apply);
})();
"""


_NO_PLOTS = (
    "<p>Nothing to plot: no column has a run with a parameter count beside another point, and no model "
    "has results at two or more iterations (partial and sample-data results are not plotted).</p>"
)


def render_html(board: Leaderboard, meta: ReportMeta, plots: Sequence[Plot]) -> str:
    """One self-contained page: controls, the table, the plots and the notes."""
    esc = html.escape
    body = "\n".join(_row_html(row, board.columns) for row in board.rows)
    note_items = "".join(f"<li>{esc(n)}</li>" for n in notes(board, meta))
    figures = "\n".join(
        f'<figure><img src="data:image/png;base64,{base64.b64encode(p.png).decode("ascii")}" '
        f'alt="{esc(p.title)}"><figcaption><b>{esc(p.title)}</b>: {esc(p.description)}.</figcaption></figure>'
        for p in plots
    )
    n_runs = sum(not r.reference for r in board.rows)
    refs = any(r.reference for r in board.rows)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>mlm-toolkit leaderboard</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        "<h1>Leaderboard</h1>\n"
        f'<p class="meta">{n_runs} model(s) from {meta.n_records} task results; ranked by '
        f"{esc(board.sort_column.label)}. Generated {esc(meta.generated.isoformat(timespec='seconds'))}.</p>\n"
        '<div class="controls"><input type="search" id="filter" placeholder="Filter models, formats, '
        'fingerprints…" aria-label="filter rows">'
        f'<label{"" if refs else " hidden"}><input type="checkbox" id="show-refs" checked> '
        "paper reference rows</label><span>Click a column header to sort.</span></div>\n"
        f'<div class="scroll"><table class="leaderboard" id="leaderboard">\n{_head_html(board.columns, rank_header(board))}\n'
        f"<tbody>\n{body}\n</tbody>\n</table></div>\n"
        f'<h2>Plots</h2>\n<div class="plots">\n{figures or _NO_PLOTS}'
        f'\n</div>\n<h2>Notes</h2>\n<ul class="notes">{note_items}</ul>\n'
        f"<script>{_SCRIPT}</script>\n</body>\n</html>\n"
    )


def _spans(labels: Sequence[str]) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for label in labels:
        if out and out[-1][0] == label:
            out[-1] = (label, out[-1][1] + 1)
        else:
            out.append((label, 1))
    return out


def _head_html(columns: Sequence[Column], rank: str) -> str:
    """Three header rows: task family, task (with the method when not the paper's), metric."""
    esc = html.escape
    why = rank.removeprefix("#").strip()  # '(unranked: sample data)' on its own narrow lines
    label = "#" + (f'<span class="why">{esc(why)}</span>' if why else "")
    top = f'<th rowspan="3" class="sortable" data-col="0" data-lower="true">{label}</th>'
    top += '<th rowspan="3" class="sortable" data-col="1">Model</th>'
    top += '<th rowspan="3" class="sortable" data-col="2" data-lower="false">Params</th>'
    top += "".join(f'<th colspan="{n}">{esc(name)}</th>' for name, n in _spans([c.family for c in columns]))
    tasks = _spans([c.task_label + (f" [{c.method_tag}]" if c.method_tag else "") for c in columns])
    middle = "".join(f'<th colspan="{n}" class="task">{esc(name)}</th>' for name, n in tasks)
    cols = "".join(
        f'<th class="sortable metric" data-col="{i + 3}" data-lower="{str(c.lower_is_better).lower()}" '
        f'title="{esc(c.label)} ({esc(c.key)})">{esc(c.metric_label)}{" %" if c.percent else ""} {c.arrow}</th>'
        for i, c in enumerate(columns)
    )
    return (
        f'<thead><tr class="families">{top}</tr>\n<tr class="tasks">{middle}</tr>\n'
        f'<tr class="columns">{cols}</tr></thead>'
    )


def _row_html(row: Row, columns: Sequence[Column]) -> str:
    esc = html.escape
    rank = rank_text(row)
    rank_html = '<span class="badge">ref</span>' if row.reference else esc(rank)
    rank_v = "" if row.rank is None else str(row.rank)
    cells = [
        f'<td class="rank" data-v="{rank_v}">{rank_html}</td>',
        f'<td class="model" data-v="{esc(row.name)}"><span class="name">{esc(row.name)}</span>'
        f'<span class="details">{esc(details_text(row))}</span></td>',
        f'<td class="num" data-v="{row.parameters or ""}">{esc(format_params(row.parameters))}</td>',
    ]
    cells += [_cell_html(row, row.cells.get(col.key), col) for col in columns]
    cls = ' class="reference"' if row.reference else ""
    return f"<tr{cls}>{''.join(cells)}</tr>"


def _cell_html(row: Row, cell: Cell | None, col: Column) -> str:
    esc = html.escape
    if cell is None:
        return f'<td class="missing">{MISSING}</td>'
    text = esc(cell_text(cell, col))
    marks = "".join(f'<span class="mark {_mark_class(m)}">{esc(m)}</span>' for m in cell.marks())
    cls = "num best" if cell.best else "num"
    value = f"<strong>{text}</strong>" if cell.best else text
    return (
        f'<td class="{cls}" data-v="{cell.value!r}" title="{esc(_provenance(row, cell))}">{value}{marks}</td>'
    )


def _mark_class(mark: str) -> str:
    return mark.split(" ", 1)[0].replace("contaminated", "contaminated")


def _provenance(row: Row, cell: Cell) -> str:
    if row.reference:
        return row.note
    seeds = ", ".join("none" if s is None else str(s) for s in cell.seeds)
    text = f"{cell.n_runs} run(s), seeds {seeds}; dtype {cell.dtype or 'not recorded'}; from {', '.join(cell.sources)}"
    if cell.variants:
        text += "; also kept: " + "; ".join(f"{what}: {value:.6g}" for what, value in cell.variants)
    return text
