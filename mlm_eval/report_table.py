"""Build the leaderboard: one row per model checkpoint, one column per task metric.

Rows are keyed by (model name, iteration, layout); columns by (task, metric, method). The method
stays in the column for zero-shot evaluations because ``paper``, ``lm-eval``, ``last-token`` and
``lm-eval-harness`` numbers are not comparable; finetuning has one official metric per task, so its
method is folded into the column. Duplicate runs of one cell are reduced with ``latest`` or
``median`` (over seeds) and the rule is stated in every output. Paper rows are references: listed
after the runs, never ranked, never marked best.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import pandas as pd

from mlm_eval.paper_reference import PAPER_ROWS, PaperRow
from mlm_eval.report_collect import RunRecord, is_percent_metric
from pretrain.utils.errors import UserError
from pretrain.utils.results import TASK_METRICS

MISSING = "—"
REDUCE_RULES = ("latest", "median")
TASK_LABELS = {
    "wikitext103": "WikiText-103",
    "lambada": "LAMBADA",
    "mnli": "MNLI",
    "qqp": "QQP",
    "squad1": "SQuAD 1.1",
    "squad2": "SQuAD 2.0",
    "race": "RACE",
    "cola": "CoLA",
    "sst2": "SST-2",
    "mrpc": "MRPC",
    "stsb": "STS-B",
    "qnli": "QNLI",
    "rte": "RTE",
    "wnli": "WNLI",
}
METRIC_LABELS = {
    "adjusted_ppl": "adj. ppl",
    "token_ppl": "token ppl",
    "word_perplexity": "word ppl",
    "byte_perplexity": "byte ppl",
    "bits_per_byte": "bits/byte",
    "accuracy": "acc",
    "accuracy_m": "m acc",
    "accuracy_mm": "mm acc",
    "accuracy_middle": "middle acc",
    "accuracy_high": "high acc",
    "exact_match": "EM",
    "f1": "F1",
    "mcc": "MCC",
    "pearson": "Pearson",
    "spearman": "Spearman",
}
_LOWER_HINTS = ("ppl", "perplexity", "loss", "bits_per", "bpb", "error")
_PLAIN_METHODS = ("paper", "")


@dataclass(frozen=True, kw_only=True)
class Column:
    """One leaderboard column: a metric of a task computed one way."""

    task: str
    metric: str
    method: str
    lower_is_better: bool
    percent: bool

    @property
    def key(self) -> str:
        return column_key(self.task, self.metric, self.method)

    @property
    def label(self) -> str:
        metric = "all acc" if (self.task, self.metric) == ("race", "accuracy") else None
        metric = metric or METRIC_LABELS.get(self.metric, self.metric)
        arrow = "↓" if self.lower_is_better else "↑"
        text = f"{TASK_LABELS.get(self.task, self.task)} {metric}{' %' if self.percent else ''} {arrow}"
        return text if self.method in _PLAIN_METHODS else f"{text} [{self.method}]"


@dataclass(frozen=True, kw_only=True)
class Cell:
    """A reduced value with where it came from."""

    value: float
    best: bool
    n_runs: int
    seeds: tuple[int | None, ...]
    sources: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Row:
    """A model checkpoint (a run row) or a published paper row (``reference``)."""

    rank: int | None
    reference: bool
    name: str
    parameters: int | None
    iteration: int | None
    layout: str | None
    note: str
    cells: Mapping[str, Cell]


@dataclass(frozen=True, kw_only=True)
class SortKey:
    """``--sort-by TASK[:METRIC][@METHOD]``."""

    task: str
    metric: str | None = None
    method: str | None = None


@dataclass(frozen=True, kw_only=True)
class TableConfig:
    """How to build the table (parsed from the CLI flags)."""

    sort_by: SortKey | None = None
    reduce: str = "latest"
    with_paper: bool = False


@dataclass(frozen=True, kw_only=True)
class Leaderboard:
    """The finished table: run rows sorted best first, then reference rows."""

    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    sort_column: Column
    reduce: str
    rule: str

    def to_frame(self) -> pd.DataFrame:
        """Numeric table (NaN where missing), one row per :class:`Row`, columns by label."""
        records = [
            {
                "rank": row.rank,
                "reference": row.reference,
                "name": row.name,
                "parameters": row.parameters,
                "iteration": row.iteration,
                "layout": row.layout,
                **{c.label: row.cells[c.key].value if c.key in row.cells else math.nan for c in self.columns},
            }
            for row in self.rows
        ]
        return pd.DataFrame.from_records(records).astype(
            {"rank": "Int64", "parameters": "Int64", "iteration": "Int64"}
        )


def column_key(task: str, metric: str, method: str) -> str:
    """``task:metric``, plus ``@method`` for a non-default method (the ``--sort-by`` syntax)."""
    return f"{task}:{metric}" if method in _PLAIN_METHODS else f"{task}:{metric}@{method}"


def parse_sort_key(text: str) -> SortKey:
    """Parse ``TASK[:METRIC][@METHOD]``; raises :class:`UserError` naming ``--sort-by``."""
    rest, _, method = text.partition("@")
    task, _, metric = rest.partition(":")
    if not task or (":" in rest and not metric) or ("@" in text and not method):
        raise UserError(f"--sort-by {text!r}: expected TASK[:METRIC][@METHOD], e.g. lambada:accuracy")
    return SortKey(task=task, metric=metric or None, method=method or None)


def lower_is_better(task: str, metric: str) -> bool:
    """Known metrics from ``TASK_METRICS``; unknown ones by name (perplexities, losses)."""
    known = TASK_METRICS.get(task, {})
    if metric in known:
        return known[metric]
    return any(hint in metric.lower() for hint in _LOWER_HINTS)


def reduce_rule(rule: str) -> str:
    """The sentence stating how duplicate runs were reduced."""
    if rule == "latest":
        return (
            "Duplicate runs of the same model, task and method: the most recent run "
            "(by its 'created' time) is shown."
        )
    return (
        "Duplicate runs of the same model, task and method: the median over seeds is shown "
        "(the latest run per seed; with an even count, the mean of the two middle values)."
    )


def build_leaderboard(records: Sequence[RunRecord], config: TableConfig) -> Leaderboard:
    """Reduce duplicates, pivot into rows and columns, rank by the sort column, mark the best."""
    if config.reduce not in REDUCE_RULES:
        raise UserError(f"--reduce {config.reduce!r}: expected one of {', '.join(REDUCE_RULES)}")
    reduced = _reduce(_long_frame(records), config.reduce)
    refs = PAPER_ROWS if config.with_paper else ()
    columns = _columns(reduced, refs)
    sort_column = _find_sort_column(columns, reduced, config.sort_by)
    runs = _run_rows(reduced)
    runs = _rank(_mark_best(runs, columns), sort_column)
    ref_rows = [_reference_row(p) for p in refs]
    ref_rows.sort(key=lambda r: _sort_value(r, sort_column)[:2])  # stable: paper order among ties
    return Leaderboard(
        columns=columns,
        rows=tuple(runs + ref_rows),
        sort_column=sort_column,
        reduce=config.reduce,
        rule=reduce_rule(config.reduce),
    )


def _column_method(kind: str, method: str) -> str:
    return "" if kind == "finetune" else method


def _long_frame(records: Sequence[RunRecord]) -> pd.DataFrame:
    """One line per (record, metric); ``None`` keys become strings so groupby keeps them."""
    lines = [
        {
            "name": r.model.name,
            "iteration": -1 if r.model.iteration is None else r.model.iteration,
            "layout": r.model.layout or "",
            "parameters": r.parameters,
            "task": r.task,
            "method": _column_method(r.kind, r.method),
            "metric": metric,
            "value": value,
            "seed": r.seed,
            "seed_key": "none" if r.seed is None else str(r.seed),
            "created": r.created,
            "path": str(r.path),
        }
        for r in records
        for metric, value in r.metrics.items()
    ]
    return pd.DataFrame.from_records(lines)


def _reduce(long: pd.DataFrame, rule: str) -> pd.DataFrame:
    cell = ["name", "iteration", "layout", "task", "method", "metric"]
    ordered = long.sort_values(["created", "path"], kind="stable")
    if rule == "latest":
        picked = ordered.groupby(cell, sort=False).tail(1)
        return picked.assign(
            n_runs=ordered.groupby(cell, sort=False)["value"].transform("size").loc[picked.index],
            seeds=picked["seed"].map(lambda s: (s,)),
            sources=picked["path"].map(lambda p: (p,)),
        )
    per_seed = ordered.groupby([*cell, "seed_key"], sort=False).tail(1)
    grouped = per_seed.groupby(cell, sort=False)
    out = grouped.agg(
        value=("value", "median"),
        parameters=("parameters", "first"),
        n_runs=("value", "size"),
        seeds=("seed", tuple),
        sources=("path", tuple),
    )
    return out.reset_index()


def _columns(reduced: pd.DataFrame, refs: Sequence[PaperRow]) -> tuple[Column, ...]:
    keys = set(zip(reduced["task"], reduced["metric"], reduced["method"], strict=True))
    for ref in refs:
        keys |= {(t, m, "paper" if ref.kind == "eval" else "") for t, m in ref.values}
    task_order = list(TASK_LABELS)

    def order(key: tuple[str, str, str]) -> tuple[int, str, int, str, int, str]:
        task, metric, method = key
        metrics = list(TASK_METRICS.get(task, {}))
        return (
            task_order.index(task) if task in task_order else len(task_order),
            task,
            metrics.index(metric) if metric in metrics else len(metrics),
            metric,
            0 if method in _PLAIN_METHODS else 1,
            method,
        )

    return tuple(
        Column(
            task=t, metric=m, method=me, lower_is_better=lower_is_better(t, m), percent=is_percent_metric(m)
        )
        for t, m, me in sorted(keys, key=order)
    )


def _find_sort_column(columns: Sequence[Column], reduced: pd.DataFrame, want: SortKey | None) -> Column:
    triples = zip(reduced["task"], reduced["metric"], reduced["method"], strict=True)
    with_runs = {f"{t}:{m}:{me}" for t, m, me in triples}
    if want is None:  # default: the first column (in task order) that has a run
        return next(c for c in columns if f"{c.task}:{c.metric}:{c.method}" in with_runs)
    for col in columns:
        method_ok = (
            want.method is None or want.method == col.method or (want.method == "paper" and col.method == "")
        )
        if col.task == want.task and (want.metric in (None, col.metric)) and method_ok:
            return col
    text = want.task + (f":{want.metric}" if want.metric else "") + (f"@{want.method}" if want.method else "")
    available = ", ".join(c.key for c in columns)
    raise UserError(f"--sort-by {text!r}: no such column in the results; available: {available}")


def _run_rows(reduced: pd.DataFrame) -> list[Row]:
    rows: list[Row] = []
    for (name, iteration, layout), group in reduced.groupby(["name", "iteration", "layout"], sort=True):
        params = group["parameters"].dropna()
        cells = {
            column_key(t, m, me): Cell(
                value=float(v),
                best=False,
                n_runs=int(n),
                seeds=tuple(None if pd.isna(x) else int(x) for x in s),
                sources=tuple(sorted(set(src))),
            )
            for t, m, me, v, n, s, src in zip(
                group["task"],
                group["metric"],
                group["method"],
                group["value"],
                group["n_runs"],
                group["seeds"],
                group["sources"],
                strict=True,
            )
        }
        rows.append(
            Row(
                rank=None,
                reference=False,
                name=str(name),
                parameters=int(params.mode().iloc[0]) if len(params) else None,
                iteration=None if iteration == -1 else int(iteration),
                layout=layout or None,
                note="",
                cells=cells,
            )
        )
    return rows


def _reference_row(ref: PaperRow) -> Row:
    cells = {}
    for (task, metric), value in ref.values.items():
        method = "paper" if ref.kind == "eval" else ""
        cells[column_key(task, metric, method)] = Cell(
            value=value, best=False, n_runs=0, seeds=(), sources=(ref.table,)
        )
    return Row(
        rank=None,
        reference=True,
        name=f"{ref.name} (paper, {ref.table})",
        parameters=ref.parameters,
        iteration=ref.iteration,
        layout=None,
        note=f"reference, {ref.table}: {ref.note}",
        cells=cells,
    )


def _mark_best(rows: list[Row], columns: Sequence[Column]) -> list[Row]:
    """Best per column among runs only, where at least two runs compete; ties are all marked."""
    best: dict[str, float] = {}
    for col in columns:
        values = [r.cells[col.key].value for r in rows if col.key in r.cells]
        if len(values) >= 2:
            best[col.key] = min(values) if col.lower_is_better else max(values)
    return [
        replace(r, cells={k: replace(c, best=c.value == best.get(k)) for k, c in r.cells.items()})
        for r in rows
    ]


def _rank(rows: list[Row], col: Column) -> list[Row]:
    """Best first by the sort column; rows without a value come last, unranked."""
    ordered = sorted(rows, key=lambda r: _sort_value(r, col))
    return [replace(r, rank=i + 1 if col.key in r.cells else None) for i, r in enumerate(ordered)]


def _sort_value(row: Row, col: Column) -> tuple[int, float, str, int]:
    cell = row.cells.get(col.key)
    value = math.inf if cell is None else (cell.value if col.lower_is_better else -cell.value)
    return (cell is None, value, row.name, -1 if row.iteration is None else row.iteration)
