"""Render a :class:`~mlm_eval.report_table.Leaderboard` as Markdown, CSV, JSON and one HTML page.

The HTML page is self-contained (inline CSS, plots embedded as base64 PNG) so it opens without a
network. Everything is rendered in memory first and then each file is written atomically, so an
error leaves no half-written report behind.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mlm_eval.paper_reference import PAPER_CITATION
from mlm_eval.report_collect import LEADERBOARD_SCHEMA, SkippedFile
from mlm_eval.report_table import MISSING, Column, Leaderboard, Row
from pretrain.utils.atomic import atomic_open

OUTPUT_NAMES = ("leaderboard.md", "leaderboard.csv", "leaderboard.json", "leaderboard.html")
META_HEADERS = ("#", "Model", "Params", "Iteration", "Layout")
MAX_PLOT_COLUMNS = 6


@dataclass(frozen=True, kw_only=True)
class ReportMeta:
    """What the report was built from, stated in every output."""

    directories: tuple[Path, ...]
    skipped: tuple[SkippedFile, ...]
    n_records: int
    generated: _dt.datetime


@dataclass(frozen=True, kw_only=True)
class Plot:
    """One embedded figure."""

    title: str
    png: bytes


def format_value(value: float | None) -> str:
    """Two decimals (the paper's precision), or the missing mark."""
    return MISSING if value is None or math.isnan(value) else f"{value:.2f}"


def format_params(n: int | None) -> str:
    """Parameter count as 355M / 2.5B."""
    if n is None:
        return MISSING
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def meta_cells(row: Row) -> list[str]:
    """The text of the row header cells (rank, name, parameters, iteration, layout)."""
    rank = "ref" if row.reference else (MISSING if row.rank is None else str(row.rank))
    iteration = MISSING if row.iteration is None else str(row.iteration)
    return [rank, row.name, format_params(row.parameters), iteration, row.layout or MISSING]


def notes(board: Leaderboard, meta: ReportMeta) -> list[str]:
    """Plain-text statements every output carries: rule, ranking, marks, references, skips."""
    out = [
        board.rule,
        f"Ranked by {board.sort_column.label} ({board.sort_column.key}), best first; rows without "
        "that value are unranked.",
        "The best value of each column among runs (where at least two runs have one) is marked in "
        "bold; ↓ lower is better, ↑ higher "
        f"is better; {MISSING} marks a missing result. Accuracy-like metrics are in percent.",
        f"{meta.n_records} task results from: {', '.join(str(d) for d in meta.directories)}.",
    ]
    if any(r.reference for r in board.rows):
        out.append(
            "Rows ranked 'ref' are published numbers from the paper (Tables 3 and 5 of "
            f"{PAPER_CITATION}): references, not runs; they are neither ranked nor marked best."
        )
    out += [f"Skipped {s.path}: {s.reason}" for s in meta.skipped]
    return out


def render_markdown(board: Leaderboard, meta: ReportMeta) -> str:
    """A GitHub-flavoured Markdown table followed by the notes."""
    headers = [*META_HEADERS, *(c.label for c in board.columns)]
    lines = [
        "# Leaderboard",
        "",
        "| " + " | ".join(_md(h) for h in headers) + " |",
        "|" + "|".join(":---" if i == 1 else "---:" for i in range(len(headers))) + "|",
    ]
    for row in board.rows:
        cells = [_md(t) for t in meta_cells(row)]
        for col in board.columns:
            cell = row.cells.get(col.key)
            text = format_value(cell.value if cell else None)
            cells.append(f"**{text}**" if cell and cell.best else text)
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Notes", ""] + [f"- {_md(n)}" for n in notes(board, meta)]
    return "\n".join(lines) + "\n"


def render_csv(board: Leaderboard) -> str:
    """Numeric CSV for spreadsheets: empty cells are missing results."""
    return str(board.to_frame().to_csv(index=False, float_format="%.6g", lineterminator="\n"))


def render_json(board: Leaderboard, meta: ReportMeta) -> str:
    """The machine-readable leaderboard (schema ``mlm-toolkit/leaderboard/v1``)."""
    doc: dict[str, Any] = {
        "schema": LEADERBOARD_SCHEMA,
        "generated": meta.generated.isoformat(timespec="seconds"),
        "results_dirs": [str(d) for d in meta.directories],
        "reduce": {"rule": board.reduce, "description": board.rule},
        "sort_by": {"column": board.sort_column.key, "label": board.sort_column.label},
        "columns": [_column_json(c) for c in board.columns],
        "rows": [_row_json(r) for r in board.rows],
        "skipped": [{"path": str(s.path), "reason": s.reason} for s in meta.skipped],
        "references": {"citation": PAPER_CITATION, "tables": ["Table 3", "Table 5"]}
        if any(r.reference for r in board.rows)
        else None,
        "notes": notes(board, meta),
    }
    return json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def _column_json(col: Column) -> dict[str, Any]:
    return {
        "key": col.key,
        "task": col.task,
        "metric": col.metric,
        "method": col.method or None,
        "label": col.label,
        "lower_is_better": col.lower_is_better,
        "unit": "%" if col.percent else None,
    }


def _row_json(row: Row) -> dict[str, Any]:
    return {
        "rank": row.rank,
        "reference": row.reference,
        "name": row.name,
        "parameters": row.parameters,
        "iteration": row.iteration,
        "layout": row.layout,
        "note": row.note or None,
        "cells": {
            key: {
                "value": c.value,
                "best": c.best,
                "n_runs": c.n_runs,
                "seeds": list(c.seeds),
                "sources": list(c.sources),
            }
            for key, c in row.cells.items()
        },
    }


def render_plots(board: Leaderboard) -> list[Plot]:
    """Metric against parameter count (log x) and metric against training iteration per model."""
    plots = []
    by_params = _plot_columns(board, lambda r: r.parameters is not None)
    if by_params:
        plots.append(Plot(title="Metric vs parameter count", png=_params_figure(board, by_params)))
    by_iter = _plot_columns(board, lambda r: r.iteration is not None)
    if by_iter:
        plots.append(Plot(title="Metric vs training iteration", png=_iteration_figure(board, by_iter)))
    return plots


def _plot_columns(board: Leaderboard, usable: Callable[[Row], bool]) -> list[Column]:
    """Columns where a usable run row has a value, at most a few."""
    cols = [
        c
        for c in board.columns
        if any(not r.reference and usable(r) and c.key in r.cells for r in board.rows)
    ]
    # The ranking column first, then the paper's own methods, then other methods (lm-eval etc.).
    cols.sort(key=lambda c: (c.key != board.sort_column.key, "@" in c.key))
    return cols[:MAX_PLOT_COLUMNS]


def _figure(n: int) -> tuple[Figure, list[Any]]:
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(4.2 * ncols, 3.4 * nrows), layout="constrained")
    FigureCanvasAgg(fig)  # explicit Agg canvas: no pyplot, no GUI backend, no global state
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(n)]
    return fig, axes


def _params_figure(board: Leaderboard, cols: Sequence[Column]) -> bytes:
    fig, axes = _figure(len(cols))
    for ax, col in zip(axes, cols, strict=True):
        for reference, marker, label in ((False, "o", "runs"), (True, "*", "paper (reference)")):
            pts = [
                (r.parameters, r.cells[col.key].value, r.name)
                for r in board.rows
                if r.reference == reference and r.parameters and col.key in r.cells
            ]
            if pts:
                xs, ys, names = zip(*pts, strict=True)
                ax.scatter(xs, ys, marker=marker, s=60 if reference else 30, label=label, alpha=0.8)
                for x, y, name in pts:
                    ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
        ax.set_title(col.label, fontsize=9)
        ax.legend(fontsize=7)
    return _png(fig)


def _iteration_figure(board: Leaderboard, cols: Sequence[Column]) -> bytes:
    fig, axes = _figure(len(cols))
    for ax, col in zip(axes, cols, strict=True):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in board.rows:
            if not r.reference and r.iteration is not None and col.key in r.cells:
                series.setdefault(r.name, []).append((r.iteration, r.cells[col.key].value))
        for name, pts in sorted(series.items()):
            xs, ys = zip(*sorted(pts), strict=True)
            ax.plot(xs, ys, marker="o", label=name)
        ax.set_xlabel("training iteration")
        ax.set_title(col.label, fontsize=9)
        ax.legend(fontsize=7)
    return _png(fig)


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table.leaderboard { border-collapse: collapse; font-size: 14px; }
table.leaderboard th, table.leaderboard td { border: 1px solid #ccc; padding: 4px 8px; }
table.leaderboard th { background: #f0f0f0; }
td.meta { white-space: nowrap; }
div.scroll { overflow-x: auto; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.best { background: #e3f6e3; }
td.missing { color: #999; text-align: center; }
tr.reference td { font-style: italic; color: #555; background: #fafaf0; }
span.badge { border: 1px solid #aa8; border-radius: 3px; padding: 0 4px; font-size: 11px; }
figure img { max-width: 100%; border: 1px solid #ddd; }
"""


def render_html(board: Leaderboard, meta: ReportMeta, plots: Sequence[Plot]) -> str:
    """One self-contained page: the table, the notes, and the plots as data-URI images."""
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in (*META_HEADERS, *(c.label for c in board.columns)))
    body = "\n".join(_html_row(row, board.columns) for row in board.rows)
    note_items = "".join(f"<li>{esc(n)}</li>" for n in notes(board, meta))
    figures = "\n".join(
        f'<figure><img src="data:image/png;base64,{base64.b64encode(p.png).decode("ascii")}" '
        f'alt="{esc(p.title)}"><figcaption>{esc(p.title)}</figcaption></figure>'
        for p in plots
    )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>mlm-toolkit leaderboard</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<h1>Leaderboard</h1>\n<p>Generated {esc(meta.generated.isoformat(timespec='seconds'))}.</p>\n"
        f'<div class="scroll"><table class="leaderboard" id="leaderboard">\n<thead><tr>{head}</tr></thead>\n'
        f"<tbody>\n{body}\n</tbody>\n</table></div>\n"
        f'<h2>Notes</h2>\n<ul class="notes">{note_items}</ul>\n<h2>Plots</h2>\n'
        f"{figures or '<p>No run has a parameter count or iteration to plot.</p>'}\n</body>\n</html>\n"
    )


def _html_row(row: Row, columns: Sequence[Column]) -> str:
    esc = html.escape
    rank, *rest = meta_cells(row)
    rank_html = '<span class="badge">ref</span>' if row.reference else esc(rank)
    cells = [f'<td class="meta">{rank_html}</td>'] + [f'<td class="meta">{esc(t)}</td>' for t in rest]
    for col in columns:
        cell = row.cells.get(col.key)
        if cell is None:
            cells.append(f'<td class="missing">{MISSING}</td>')
            continue
        text = esc(format_value(cell.value))
        tip = esc(_provenance(row, cell.n_runs, cell.seeds, cell.sources))
        cls = "num best" if cell.best else "num"
        cells.append(
            f'<td class="{cls}" title="{tip}">{f"<strong>{text}</strong>" if cell.best else text}</td>'
        )
    cls = ' class="reference"' if row.reference else ""
    return f"<tr{cls}>{''.join(cells)}</tr>"


def _provenance(row: Row, n_runs: int, seeds: Sequence[int | None], sources: Sequence[str]) -> str:
    if row.reference:
        return row.note
    return f"{n_runs} run(s), seeds {', '.join(str(s) for s in seeds)}; from {', '.join(sources)}"


def write_outputs(board: Leaderboard, meta: ReportMeta, out_dir: Path) -> list[Path]:
    """Render all four files in memory, then write each atomically into ``out_dir``."""
    plots = render_plots(board)
    texts = dict(
        zip(
            OUTPUT_NAMES,
            (
                render_markdown(board, meta),
                render_csv(board),
                render_json(board, meta),
                render_html(board, meta, plots),
            ),
            strict=True,
        )
    )
    paths = []
    for name, text in texts.items():
        with atomic_open(out_dir / name, "w", encoding="utf-8") as fh:
            fh.write(text)
        paths.append(out_dir / name)
    return paths


def _md(text: str) -> str:
    return text.replace("|", "\\|")
