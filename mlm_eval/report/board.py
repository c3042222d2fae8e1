"""The leaderboard's types: a :class:`Cell` (one shown result and its marks), a :class:`Row` (one
model or paper reference), the sort key and the table settings; built by
:func:`mlm_eval.report.table.build_leaderboard`, rendered by :mod:`mlm_eval.report.render`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mlm_eval.report.columns import Column, format_value
from mlm_eval.report.records import HygieneRecord
from pretrain.utils.errors import UserError

REDUCE_RULES = ("latest", "median")


@dataclass(frozen=True, kw_only=True)
class Cell:
    """A reduced value with its provenance and marks."""

    value: float
    best: bool = False
    n_runs: int = 1
    seeds: tuple[int | None, ...] = ()
    sources: tuple[str, ...] = ()
    dtype: str | None = None
    limit: int | None = None  # a partial result (--limit N; 0: partial, count unknown)
    sample_data: bool = False
    reduced_precision: bool = False
    forced_tokenizer: bool = False  # a --force-tokenizer result: not the model's own tokenizer
    contamination: float | None = None  # percent of the eval set's n-grams found in training data
    variants: tuple[tuple[str, float], ...] = ()  # other kept results: (description, value)
    # older runs of the same group (model, task, method, dtype) that printed another value than the
    # one shown: (file, value), oldest first; --reduce latest would otherwise hide the conflict
    older: tuple[tuple[str, float], ...] = ()

    @property
    def partial(self) -> bool:
        return self.limit is not None

    @property
    def comparable(self) -> bool:
        """A full run on real data: may be ranked and marked best."""
        return not self.partial and not self.sample_data and not self.forced_tokenizer

    def marks(self) -> list[str]:
        """Short plain-text marks, in a fixed order (see :data:`MARK_LEGEND`)."""
        out = []
        if self.partial:
            out.append(f"partial n={self.limit}" if self.limit else "partial")
        if self.reduced_precision:
            out.append(_SHORT_DTYPES.get(self.dtype or "", self.dtype or "reduced precision"))
        if self.sample_data:
            out.append("sample data")
        if self.forced_tokenizer:
            out.append("forced tokenizer")
        if self.contamination is not None:
            out.append(f"contaminated {format_value(self.contamination, percent=True)}%")
        if self.older:
            out.append("older differs")
        return out


_SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}
MARK_LEGEND = (
    ("partial", "a --limit run on the first N examples only: not comparable, never ranked or best"),
    ("bf16/fp16", "evaluated with reduced-precision (bfloat16/float16) weights"),
    ("sample data", "the built-in sample data, not the real test set; never ranked or best"),
    (
        "forced tokenizer",
        "evaluated with --force-tokenizer (a tokenizer other than the checkpoint's); never ranked or best",
    ),
    (
        "contaminated X%",
        "X% of the eval set's n-grams occur in the model's training data (mlm-eval contamination)",
    ),
    (
        "older differs",
        "an older run of the same weights, task, method and dtype gave another value (the notes list "
        "it); the newest is shown",
    ),
)


@dataclass(frozen=True, kw_only=True)
class Row:
    """A model (a run row) or a published paper row (``reference``)."""

    rank: int | None
    reference: bool
    name: str
    parameters: int | None
    iteration: int | None
    cells: Mapping[str, Cell]
    fingerprint: str | None = None
    aliases: tuple[str, ...] = ()  # other model names its records carry
    formats: tuple[str, ...] = ()  # layouts / formats it was evaluated in
    note: str = ""
    table: str | None = None  # the paper table of a reference row

    @property
    def layout(self) -> str | None:
        return ", ".join(self.formats) or None


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
    """The finished table: ranked run rows, unranked run rows, then reference rows."""

    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    sort_column: Column
    reduce: str
    rule: str
    unmatched_hygiene: tuple[HygieneRecord, ...] = field(default=())


def parse_sort_key(text: str) -> SortKey:
    """Parse ``TASK[:METRIC][@METHOD]``; raises :class:`UserError` naming ``--sort-by``."""
    rest, _, method = text.partition("@")
    task, _, metric = rest.partition(":")
    if not task or (":" in rest and not metric) or ("@" in text and not method):
        raise UserError(f"--sort-by {text!r}: expected TASK[:METRIC][@METHOD], e.g. lambada:accuracy")
    return SortKey(task=task, metric=metric or None, method=method or None)


def reduce_rule(rule: str) -> str:
    """The sentence stating how duplicate runs were reduced."""
    head = "Per model, task, method and dtype the full runs win over partial (--limit) runs; then "
    if rule == "latest":
        return head + "the most recent run (by its 'created' time) is shown."
    return head + (
        "the median over seeds is shown (the latest run per seed; with an even count, the mean of "
        "the two middle values)."
    )
