"""Build the leaderboard: one row per model (weights), one column per task metric.

A row is a set of weights: records with the same weights fingerprint (every layout, reshard and
Hugging Face export of one checkpoint) share it; a record without a fingerprint is keyed by its
model name and iteration. The layouts and formats a row was evaluated in are its detail. Columns
are (task, metric, method): the method stays in the column for zero-shot evaluations because
``paper``, ``lm-eval``, ``last-token`` and ``lm-eval-harness`` numbers are not comparable;
finetuning has one official metric per task, so its method is folded into the column.

Per (model, task, method, dtype) the newest *full* result is kept (a partial ``--limit`` run only
when no full run exists), or with ``--reduce median`` the median over seeds. A cell shows the kept
result in full precision if there is one (bf16/fp16 otherwise, marked); the other kept results are
listed as its variants. Paper rows are references: after the runs, never ranked, never best.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from mlm_eval.report.board import (
    MARK_LEGEND,
    REDUCE_RULES,
    Cell,
    Leaderboard,
    Row,
    SortKey,
    TableConfig,
    parse_sort_key,
    reduce_rule,
)
from mlm_eval.report.columns import (
    HYGIENE_TASK,
    MISSING,
    Column,
    column_key,
    format_value,
    make_columns,
    meaningful_gap,
)
from mlm_eval.report.paper_reference import PAPER_ROWS, PaperRow
from mlm_eval.report.records import HygieneRecord, RunRecord, is_percent_metric
from pretrain.utils.errors import UserError

__all__ = [
    "MARK_LEGEND", "MISSING", "REDUCE_RULES", "Cell", "Column", "Leaderboard", "Row", "SortKey", "TableConfig",
    "build_leaderboard", "column_key", "format_value", "parse_sort_key", "reduce_rule",
]  # fmt: skip


def build_leaderboard(
    records: Sequence[RunRecord], config: TableConfig, hygiene: Sequence[HygieneRecord] = ()
) -> Leaderboard:
    """Group records into models, reduce duplicates, rank by the sort column, mark the best."""
    if config.reduce not in REDUCE_RULES:
        raise UserError(f"--reduce {config.reduce!r}: expected one of {', '.join(REDUCE_RULES)}")
    refs = PAPER_ROWS if config.with_paper else ()
    triples = {(r.task, m, _column_method(r.kind, r.method)) for r in records for m in r.metrics}
    columns = make_columns(triples)  # only columns some run has; references fill those they share
    sort_column = _find_sort_column(columns, triples, config.sort_by)
    groups = _group_models(records)
    runs = [_run_row(key, recs, columns, config.reduce) for key, recs in groups.items()]
    runs, unmatched = _attach_hygiene(runs, hygiene, columns)
    overlap = {  # the Data hygiene columns: contamination shares attached to rows
        (HYGIENE_TASK, k.partition(":")[2], "") for r in runs for k in r.cells if k.startswith(HYGIENE_TASK)
    }
    columns = make_columns(triples | overlap)
    runs = _rank(_mark_best(runs, columns), sort_column)
    ref_rows = [_reference_row(p, columns) for p in refs]
    ref_rows = sorted((r for r in ref_rows if r.cells), key=lambda r: _sort_value(r, sort_column)[:3])
    return Leaderboard(
        columns=columns,
        rows=tuple(runs + ref_rows),
        sort_column=sort_column,
        reduce=config.reduce,
        rule=reduce_rule(config.reduce),
        unmatched_hygiene=tuple(unmatched),
    )


def _column_method(kind: str, method: str) -> str:
    return "" if kind == "finetune" else method


def _group_models(records: Sequence[RunRecord]) -> dict[str, list[RunRecord]]:
    """Records by weights: the fingerprint, else ``name@iteration``."""
    groups: dict[str, list[RunRecord]] = {}
    for r in records:
        key = r.model.fingerprint or f"name:{r.model.name}@{r.model.iteration}"
        groups.setdefault(key, []).append(r)
    return groups


def _run_row(key: str, recs: list[RunRecord], columns: Sequence[Column], rule: str) -> Row:
    newest = max(recs, key=lambda r: (r.created, str(r.path)))
    oldest = min(recs, key=lambda r: (r.created, str(r.path)))
    counts = Counter(r.model.name for r in recs)  # the most used name, then the first reported
    names = sorted(counts, key=lambda n: (-counts[n], n != oldest.model.name, n))
    params = [r.parameters for r in recs if r.parameters is not None]
    iterations = {r.model.iteration for r in recs if r.model.iteration is not None}
    cells = {}
    for col in columns:
        picked = [r for r in recs if _in_column(r, col)]
        if picked:
            cells[col.key] = _reduce_cell(picked, col.metric, rule)
    return Row(
        rank=None,
        reference=False,
        name=names[0],
        aliases=tuple(names[1:]),
        parameters=max(set(params), key=params.count) if params else None,
        iteration=max(iterations) if iterations else None,
        cells=cells,
        fingerprint=newest.model.fingerprint,
        formats=tuple(sorted({_format_of(r) for r in recs})),
    )


def _in_column(r: RunRecord, col: Column) -> bool:
    return r.task == col.task and col.metric in r.metrics and _column_method(r.kind, r.method) == col.method


def _format_of(r: RunRecord) -> str:
    if r.model.layout:
        return r.model.layout
    return "lm-eval-harness" if r.source == "lm-eval-harness" else "HF"


def _reduce_cell(recs: list[RunRecord], metric: str, rule: str) -> Cell:
    """Per dtype: full runs win over partial ones, then latest/median; shown: a full run before a
    partial one, then full precision before bf16/fp16; the others are the cell's variants.
    A --force-tokenizer run is its own group, shown only when there is no other."""
    by_dtype: dict[tuple[str | None, bool], list[RunRecord]] = {}
    for r in recs:
        by_dtype.setdefault((r.dtype, r.forced_tokenizer), []).append(r)
    kept = []
    for group in by_dtype.values():
        full = [r for r in group if not r.partial]
        kept.append(_reduce_group(full or group, metric, rule, n_total=len(group)))
    kept.sort(
        key=lambda c: (c.forced_tokenizer, c.partial, c.reduced_precision, c.sample_data)
    )  # full data first
    shown, others = kept[0], kept[1:]
    variants = tuple((o.dtype or "dtype not recorded") + (", partial" if o.partial else "")
                     + (", forced tokenizer" if o.forced_tokenizer else "") for o in others)  # fmt: skip
    return replace(shown, variants=tuple(zip(variants, (o.value for o in others), strict=True)))


def _reduce_group(recs: list[RunRecord], metric: str, rule: str, *, n_total: int) -> Cell:
    ordered = sorted(recs, key=lambda r: (r.created, str(r.path)))
    latest = ordered[-1]
    older: tuple[tuple[str, float], ...] = ()
    if rule == "latest":
        chosen, value = [latest], latest.metrics[metric]
        shown = format_value(value, percent=is_percent_metric(metric))
        older = tuple(
            (str(r.path), r.metrics[metric])
            for r in ordered[:-1]
            if format_value(r.metrics[metric], percent=is_percent_metric(metric)) != shown
        )
    else:
        per_seed = {r.seed: r for r in ordered}  # the latest run per seed
        chosen = list(per_seed.values())
        values = sorted(r.metrics[metric] for r in chosen)
        mid = len(values) // 2
        value = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return Cell(
        value=float(value),
        n_runs=n_total if rule == "latest" else len(chosen),
        seeds=tuple(r.seed for r in chosen),
        sources=tuple(sorted({str(r.path) for r in chosen})),
        dtype=latest.dtype,
        limit=latest.limit,
        sample_data=any(r.sample_data for r in chosen),
        reduced_precision=latest.reduced_precision,
        forced_tokenizer=any(r.forced_tokenizer for r in chosen),
        older=older,
    )


def _attach_hygiene(
    rows: list[Row], hygiene: Sequence[HygieneRecord], columns: Sequence[Column]
) -> tuple[list[Row], list[HygieneRecord]]:
    """The newest contamination share of (model, eval task) beside that model's scores on the task."""
    latest: dict[tuple[str, str], HygieneRecord] = {}
    for h in sorted(hygiene, key=lambda h: h.created):
        latest[(h.fingerprint or h.name, h.eval_task)] = h
    used: set[tuple[str, str]] = set()
    out = []
    for row in rows:
        ids = {row.name, *row.aliases} | ({row.fingerprint} if row.fingerprint else set())
        cells = dict(row.cells)
        marked: set[tuple[str, str]] = set()  # beside the first metric of each task and method
        for col in columns:
            hit = next((latest[(i, col.task)] for i in sorted(ids) if (i, col.task) in latest), None)
            if hit is not None and col.key in cells and (col.task, col.method) not in marked:
                cells[col.key] = replace(cells[col.key], contamination=hit.share)
                used.add((hit.fingerprint or hit.name, col.task))
                marked.add((col.task, col.method))
        for task in sorted({c.task for c in columns if c.key in cells}):  # the Data hygiene columns
            hit = next((latest[(i, task)] for i in sorted(ids) if (i, task) in latest), None)
            if hit is not None:
                cells[column_key(HYGIENE_TASK, task, "")] = Cell(
                    value=hit.share, seeds=(None,), sources=(str(hit.path),)
                )
        out.append(replace(row, cells=cells))
    return out, [h for k, h in latest.items() if k not in used]


def _find_sort_column(
    columns: Sequence[Column], with_runs: set[tuple[str, str, str]], want: SortKey | None
) -> Column:
    if want is None:  # default: the first column (in task order) that has a run
        return next(c for c in columns if (c.task, c.metric, c.method) in with_runs)
    for col in columns:
        method_ok = (
            want.method is None or want.method == col.method or (want.method == "paper" and col.method == "")
        )
        if col.task == want.task and (want.metric in (None, col.metric)) and method_ok:
            return col
    text = want.task + (f":{want.metric}" if want.metric else "") + (f"@{want.method}" if want.method else "")
    available = ", ".join(c.key for c in columns)
    raise UserError(f"--sort-by {text!r}: no such column in the results; available: {available}")


def _reference_row(ref: PaperRow, columns: Sequence[Column]) -> Row:
    method = "paper" if ref.kind == "eval" else ""
    keys = {c.key for c in columns}
    cells = {
        key: Cell(value=value, n_runs=0, sources=(ref.table,))
        for (task, metric), value in ref.values.items()
        if (key := column_key(task, metric, method)) in keys
    }
    return Row(
        rank=None,
        reference=True,
        name=ref.name,
        parameters=ref.parameters,
        iteration=ref.iteration,
        cells=cells,
        formats=(f"paper {ref.table}",),
        note=f"paper {ref.table}: {ref.note}",
        table=ref.table,
    )


def _mark_best(rows: list[Row], columns: Sequence[Column]) -> list[Row]:
    """Best per column among comparable runs (full, real data), where at least two compete and the
    best beats the runner-up by at least the precision the value is reported with; ties: none."""
    best: dict[str, float] = {}
    for col in columns:
        values = sorted(
            (r.cells[col.key].value for r in rows if col.key in r.cells and r.cells[col.key].comparable),
            reverse=not col.lower_is_better,
        )
        if col.task != HYGIENE_TASK and len(values) >= 2 and meaningful_gap(values[0], values[1], col):
            best[col.key] = values[0]
    return [
        replace(
            r,
            cells={k: replace(c, best=c.comparable and c.value == best.get(k)) for k, c in r.cells.items()},
        )
        for r in rows
    ]


def _rank(rows: list[Row], col: Column) -> list[Row]:
    """Best first by the sort column; rows without a comparable value come last, unranked."""
    ordered = sorted(rows, key=lambda r: _sort_value(r, col))
    return [replace(r, rank=i + 1 if _ranked(r, col) else None) for i, r in enumerate(ordered)]


def _ranked(row: Row, col: Column) -> bool:
    cell = row.cells.get(col.key)
    return cell is not None and cell.comparable


def _sort_value(row: Row, col: Column) -> tuple[int, int, float, str, int]:
    cell = row.cells.get(col.key)
    value = float("inf") if cell is None else (cell.value if col.lower_is_better else -cell.value)
    return (
        cell is None,
        not _ranked(row, col),
        value,
        row.name,
        -1 if row.iteration is None else row.iteration,
    )
