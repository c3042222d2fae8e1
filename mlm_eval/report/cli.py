"""``mlm-eval report``: every result JSON under some directories into one ranked leaderboard.

Reads ``mlm-toolkit/result/v1`` records (from ``mlm-eval`` and ``mlm-finetune``) and
lm-evaluation-harness result files, skips malformed or foreign JSON with a warning line each, and
writes ``leaderboard.{md,csv,json,html}`` into ``--out``. Example::

    mlm-eval report --results results/ ft_results/ --out report/ --sort-by lambada \\
        --reduce median --with-paper
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mlm_eval.report.collect import collect_results
from mlm_eval.report.columns import Column, format_params
from mlm_eval.report.render import write_outputs
from mlm_eval.report.table import (
    REDUCE_RULES,
    Leaderboard,
    SortKey,
    TableConfig,
    build_leaderboard,
    parse_sort_key,
)
from mlm_eval.report.text import ReportMeta, cell_text, details_text, notes, rank_header, rank_text
from pretrain.utils.errors import UserError

_MODEL_WIDTH = 26
_RANK_WIDTH = 12  # '# (unranked: sample data)' wraps to this width
_HEADER_WRAP = 12
_META_WIDTH = 6 + _MODEL_WIDTH + 4  # rank and model columns with borders and padding


@dataclass(frozen=True, kw_only=True)
class ReportConfig:
    """Parsed ``mlm-eval report`` flags."""

    results: tuple[Path, ...]
    out: Path
    sort_by: SortKey | None
    reduce: str
    with_paper: bool


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``report`` subcommand."""
    p = subparsers.add_parser(
        "report",
        help="collect result JSON files into a ranked leaderboard (md, csv, json, html)",
        description=__doc__.splitlines()[0],
    )
    p.add_argument(
        "--results", nargs="+", required=True, metavar="DIR", help="directories to search (recursively)"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output directory for leaderboard.*")
    p.add_argument(
        "--sort-by",
        metavar="TASK[:METRIC][@METHOD]",
        help="rank by this column (default: the first task column with a run), "
        "e.g. wikitext103 or mnli:accuracy_mm",
    )
    p.add_argument(
        "--reduce",
        choices=REDUCE_RULES,
        default="latest",
        help="duplicate runs of one model+task+method: latest run, or median over seeds (default: latest)",
    )
    p.add_argument(
        "--with-paper", action="store_true", help="add the paper's Tables 3 and 5 as reference rows"
    )
    p.set_defaults(func=run)


def parse_config(args: argparse.Namespace) -> ReportConfig:
    """Flags -> :class:`ReportConfig`."""
    return ReportConfig(
        results=tuple(Path(d) for d in args.results),
        out=Path(args.out),
        sort_by=parse_sort_key(args.sort_by) if args.sort_by else None,
        reduce=args.reduce,
        with_paper=bool(args.with_paper),
    )


def run(args: argparse.Namespace) -> int:
    """Collect, build, write, print. Returns the exit code."""
    config = parse_config(args)
    from pretrain.utils.outputs import check_writable_output

    check_writable_output(config.out, kind="dir", flag="--out")  # before any work (a file, read-only)
    collection = collect_results(config.results)
    for skipped in collection.skipped:
        print(f"warning: skipped {skipped.path}: {skipped.reason}", file=sys.stderr)
    if not collection.records:
        dirs = ", ".join(str(d) for d in config.results)
        raise UserError(
            f"--results {dirs}: no valid result file found "
            f"({collection.files_seen} JSON file(s) seen, {len(collection.skipped)} skipped)"
        )
    board = build_leaderboard(
        collection.records,
        TableConfig(sort_by=config.sort_by, reduce=config.reduce, with_paper=config.with_paper),
        collection.hygiene,
    )
    meta = ReportMeta(
        directories=collection.directories,
        skipped=collection.skipped,
        ignored=collection.ignored,
        n_records=len(collection.records),
        generated=_dt.datetime.now(_dt.timezone.utc),
    )
    paths = write_outputs(board, meta, config.out)
    console = Console()
    for table in rich_tables(board, console.width):
        console.print(table)
    for line in notes(board, meta):
        console.print(escape(line), style="dim")
    for path in paths:
        console.print(f"wrote {escape(str(path))}")
    return 0


def rich_tables(board: Leaderboard, width: int) -> list[Table]:
    """The leaderboard for the terminal, its task columns split over tables that fit ``width``.

    Best cells are bold green, marks follow the value in brackets, reference rows dim italic.
    """
    chunks: list[list[Column]] = [[]]
    rank = rank_header(board)
    meta_width = _META_WIDTH + max(0, min(len(rank), _RANK_WIDTH) - 3)  # an explained '#' is wider
    used = meta_width
    for col in board.columns:
        need = min(max(len(col.label), 6), _HEADER_WRAP) + 3  # headers wrap at spaces
        if chunks[-1] and used + need > width:
            chunks.append([])
            used = meta_width
        chunks[-1].append(col)
        used += need
    tables = []
    for i, chunk in enumerate(chunks):
        title = "Leaderboard" + (f" ({i + 1}/{len(chunks)})" if len(chunks) > 1 else "")
        table = Table(title=title, caption="bold green: best among full runs; ↓ lower is better; ref: paper")
        table.add_column(escape(rank), justify="right", max_width=_RANK_WIDTH)
        table.add_column("Model (params; details)", max_width=_MODEL_WIDTH)
        for col in chunk:
            table.add_column(escape(col.label), justify="right", max_width=_HEADER_WRAP, overflow="fold")
        for row in board.rows:
            name = escape(f"{row.name} (paper, {row.table})" if row.reference else row.name)
            details = escape(f"{format_params(row.parameters)}; {details_text(row)}")
            cells = [escape(rank_text(row)), f"{name}\n[dim]{details}[/]"]
            for col in chunk:
                cell = row.cells.get(col.key)
                text = escape(cell_text(cell, col))
                text = f"[bold green]{text}[/]" if cell and cell.best else text
                marks = cell.marks() if cell else []
                cells.append(text + (f"\n[yellow]{escape('[' + ', '.join(marks) + ']')}[/]" if marks else ""))
            table.add_row(*cells, style="dim italic" if row.reference else None)
        tables.append(table)
    return tables
