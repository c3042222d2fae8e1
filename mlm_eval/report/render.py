"""Render a :class:`~mlm_eval.report.board.Leaderboard` as Markdown, CSV, JSON and one HTML page.

All four carry the same content: one row per model with its fingerprint, parameters, iteration
and the layouts/formats it was evaluated in; the values as printed (significant digits, see
:mod:`mlm_eval.report.columns`); the marks (partial, reduced precision, sample data,
contamination); the best marks; the notes (the texts all outputs share are in
:mod:`mlm_eval.report.text`). Everything is rendered in memory first and then each
file is written atomically, so an error leaves no half-written report behind.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from mlm_eval.report.board import Cell, Leaderboard, Row
from mlm_eval.report.columns import Column, format_params
from mlm_eval.report.html import render_html
from mlm_eval.report.paper_reference import PAPER_CITATION
from mlm_eval.report.plots import render_plots
from mlm_eval.report.records import LEADERBOARD_SCHEMA
from mlm_eval.report.text import (
    META_HEADERS,
    ReportMeta,
    cell_text,
    details_text,
    notes,
    rank_header,
    rank_text,
    row_name,
)
from pretrain.utils.atomic import atomic_open

OUTPUT_NAMES = ("leaderboard.md", "leaderboard.csv", "leaderboard.json", "leaderboard.html")


def _marked(cell: Cell | None, col: Column) -> str:
    text = cell_text(cell, col)
    if cell is None:
        return text
    marks = cell.marks()
    return text + (f" [{', '.join(marks)}]" if marks else "")


def render_markdown(board: Leaderboard, meta: ReportMeta) -> str:
    """A GitHub-flavoured Markdown table (best in bold, marks in brackets) followed by the notes."""
    headers = [rank_header(board), *META_HEADERS[1:], *(c.label for c in board.columns)]
    lines = [
        "# Leaderboard",
        "",
        "Columns by task family: "
        + "; ".join(
            f"{fam}: {', '.join(dict.fromkeys(c.task_label for c in board.columns if c.family == fam))}"
            for fam in dict.fromkeys(c.family for c in board.columns)
        )
        + ".",
        "",
        "| " + " | ".join(_md(h) for h in headers) + " |",
        "|" + "|".join(":---" if i in (1, 3) else "---:" for i in range(len(headers))) + "|",
    ]
    for row in board.rows:
        cells = [rank_text(row), _md(row_name(row)), format_params(row.parameters), _md(details_text(row))]
        for col in board.columns:
            cell = row.cells.get(col.key)
            text = _md(_marked(cell, col))
            cells.append(f"**{text}**" if cell and cell.best else text)
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Notes", ""] + [f"- {_md(n)}" for n in notes(board, meta)]
    return "\n".join(lines) + "\n"


def render_csv(board: Leaderboard) -> str:
    """One line per row: the printed values (empty when missing), then every cell's marks."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(
        ["rank", "reference", "model", "fingerprint", "parameters", "iteration", "formats", "aliases"]
        + [c.label for c in board.columns]
        + ["best", "marks"]
    )
    for row in board.rows:
        values = [cell_text(row.cells[c.key], c) if c.key in row.cells else "" for c in board.columns]
        marks = [f"{c.key}: {', '.join(row.cells[c.key].marks())}" for c in board.columns
                 if c.key in row.cells and row.cells[c.key].marks()]  # fmt: skip
        best = [c.key for c in board.columns if c.key in row.cells and row.cells[c.key].best]
        writer.writerow(
            [
                "" if row.rank is None else row.rank,
                row.reference,
                row_name(row),
                row.fingerprint or "",
                "" if row.parameters is None else row.parameters,
                "" if row.iteration is None else row.iteration,
                "; ".join(row.formats),
                "; ".join(row.aliases),
                *values,
                "; ".join(best),
                "; ".join(marks),
            ]
        )
    return buf.getvalue()


def render_json(board: Leaderboard, meta: ReportMeta) -> str:
    """The machine-readable leaderboard (schema ``mlm-toolkit/leaderboard/v1``)."""
    doc: dict[str, Any] = {
        "schema": LEADERBOARD_SCHEMA,
        "generated": meta.generated.isoformat(timespec="seconds"),
        "results_dirs": [str(d) for d in meta.directories],
        "reduce": {"rule": board.reduce, "description": board.rule},
        "sort_by": {"column": board.sort_column.key, "label": board.sort_column.label},
        "columns": [_column_json(c) for c in board.columns],
        "rows": [_row_json(r, board.columns) for r in board.rows],
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
        "family": col.family,
        "task": col.task,
        "metric": col.metric,
        "method": col.method or None,
        "label": col.label,
        "lower_is_better": col.lower_is_better,
        "unit": col.unit or None,
    }


def _row_json(row: Row, columns: tuple[Column, ...]) -> dict[str, Any]:
    by_key = {c.key: c for c in columns}
    return {
        "rank": row.rank,
        "reference": row.reference,
        "name": row.name,
        "table": row.table,
        "fingerprint": row.fingerprint,
        "aliases": list(row.aliases),
        "parameters": row.parameters,
        "iteration": row.iteration,
        "formats": list(row.formats),
        "note": row.note or None,
        "cells": {
            key: {
                "value": c.value,
                "text": cell_text(c, by_key[key]),
                "best": c.best,
                "marks": c.marks(),
                "partial": c.partial,
                "limit": c.limit,
                "dtype": c.dtype,
                "sample_data": c.sample_data,
                "contamination_percent": c.contamination,
                "n_runs": c.n_runs,
                "seeds": list(c.seeds),
                "sources": list(c.sources),
                "variants": [{"what": what, "value": v} for what, v in c.variants],
            }
            for key, c in row.cells.items()
        },
    }


def write_outputs(board: Leaderboard, meta: ReportMeta, out_dir: Path) -> list[Path]:
    """Render all four files in memory, then write each atomically into ``out_dir``."""
    texts = dict(
        zip(
            OUTPUT_NAMES,
            (
                render_markdown(board, meta),
                render_csv(board),
                render_json(board, meta),
                render_html(board, meta, render_plots(board)),
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
