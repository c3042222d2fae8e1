"""The texts every leaderboard output shares: what the report was built from, a cell's printed
value, a row's rank and details, and the notes (rules, ranking, marks, references, skips).

The terminal table (:mod:`mlm_eval.report.cli`), the Markdown/CSV/JSON files
(:mod:`mlm_eval.report.render`) and the HTML page (:mod:`mlm_eval.report.html`) all print these,
so they say the same thing.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from pathlib import Path

from mlm_eval.report.board import MARK_LEGEND, Cell, Leaderboard, Row
from mlm_eval.report.columns import MISSING, Column, format_value
from mlm_eval.report.paper_reference import PAPER_CITATION
from mlm_eval.report.records import SkippedFile
from pretrain.checkpoint.fingerprint import short_fingerprint

META_HEADERS = ("#", "Model", "Params", "Details")


@dataclass(frozen=True, kw_only=True)
class ReportMeta:
    """What the report was built from, stated in every output."""

    directories: tuple[Path, ...]
    skipped: tuple[SkippedFile, ...]
    n_records: int
    generated: _dt.datetime
    ignored: tuple[Path, ...] = ()  # files a result record names as its own outputs


def cell_text(cell: Cell | None, col: Column) -> str:
    """The value as printed (no marks)."""
    return format_value(cell.value if cell else None, percent=col.percent)


def rank_text(row: Row) -> str:
    return "ref" if row.reference else (MISSING if row.rank is None else str(row.rank))


def rank_header(board: Leaderboard) -> str:
    """``#``, or ``# (unranked: why)`` when no run row is ranked, so that a column of dashes is
    explained where it is read (e.g. every run used the built-in sample data)."""
    runs = [r for r in board.rows if not r.reference]
    if not runs or any(r.rank is not None for r in runs):
        return "#"
    cells = [c for r in runs if (c := r.cells.get(board.sort_column.key)) is not None]
    why = [w for w, hit in (("sample data", any(c.sample_data for c in cells)),
                            ("partial", any(c.partial for c in cells)),
                            ("forced tokenizer", any(c.forced_tokenizer for c in cells))) if hit]  # fmt: skip
    return f"# (unranked: {', '.join(why) or 'no value'})"


def details_text(row: Row) -> str:
    """Fingerprint, iteration, layouts/formats and other names of a row, or the paper table."""
    if row.reference:
        return row.note
    parts = []
    if row.fingerprint:
        parts.append(short_fingerprint(row.fingerprint))
    if row.iteration is not None:
        parts.append(f"iter {row.iteration}")
    if row.formats:
        parts.append(", ".join(row.formats))
    if row.aliases:
        parts.append("also named " + ", ".join(row.aliases))
    return "; ".join(parts) or MISSING


def row_name(row: Row) -> str:
    return f"{row.name} (paper, {row.table})" if row.reference else row.name


def notes(board: Leaderboard, meta: ReportMeta) -> list[str]:
    """Plain-text statements every output carries: rules, ranking, marks, references, skips."""
    out = [
        "One row per model: results with the same weights fingerprint (every layout, reshard and "
        "Hugging Face export of one checkpoint) share a row; results without one are grouped by "
        "model name and iteration. Details list the fingerprint and the layouts/formats evaluated.",
        board.rule,
        f"Ranked by {board.sort_column.label} ({board.sort_column.key}), best first; rows whose value "
        "is missing, partial or from sample data are unranked.",
        "Best (bold) only where a full run on real data beats every other by at least the printed "
        "precision (0.01 for percent, the 4th significant figure otherwise); ↓ lower is better, "
        f"↑ higher is better; {MISSING} marks a missing result. Accuracy-like metrics are in percent.",
        *(f"Mark '{mark}': {text}." for mark, text in MARK_LEGEND),
        f"{meta.n_records} task results from: {', '.join(str(d) for d in meta.directories)}.",
    ]
    if any(r.reference for r in board.rows):
        out.append(
            "Rows ranked 'ref' are published numbers from the paper (Tables 3 and 5 of "
            f"{PAPER_CITATION}): references, not runs; they are neither ranked nor marked best."
        )
    out += [
        f"Contamination record {h.path} ({h.name}, {h.eval_task}) matches no model row by name or fingerprint."
        for h in board.unmatched_hygiene
    ]
    out += _conflict_notes(board)
    if meta.ignored:
        out.append(f"Ignored {len(meta.ignored)} output file(s) that result records name as their own "
                   "(e.g. mlm-finetune's predictions).")  # fmt: skip
    out += [f"Skipped {s.path}: {s.reason}" for s in meta.skipped]
    return out


def _conflict_notes(board: Leaderboard) -> list[str]:
    """One line per cell marked 'older differs': the value shown and the older ones it hides."""
    out = []
    for row in board.rows:
        for col in board.columns:
            cell = row.cells.get(col.key)
            if cell is None or not cell.older:
                continue
            older = "; ".join(f"{format_value(v, percent=col.percent)} ({path})" for path, v in cell.older)
            out.append(
                f"Conflicting results for {row_name(row)}, {col.label}: the newest, {cell_text(cell, col)} "
                f"({', '.join(cell.sources)}), is shown; older: {older}."
            )
    return out
