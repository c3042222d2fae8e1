"""The records a leaderboard is built from, and the value rules every result reader shares.

:class:`RunRecord` (one task result of one run, metrics on display scale), :class:`HygieneRecord`
(a contamination share), :class:`SkippedFile`, the :class:`MalformedResult` a reader raises, and
:func:`to_percent` (accuracy-like metrics to percent by declared unit or producer). Readers:
:mod:`mlm_eval.report.collect` (our records, and the dispatch) and
:mod:`mlm_eval.report.harness_results` (lm-evaluation-harness files).
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LEADERBOARD_SCHEMA = "mlm-toolkit/leaderboard/v1"
SOURCE_TOOLKIT = "mlm-toolkit"
SOURCE_HARNESS = "lm-eval-harness"
_PERCENT_PREFIXES = ("accuracy", "acc", "f1", "exact_match", "em", "mcc", "pearson", "spearman", "share")
UNITS = ("percent", "fraction")
REDUCED_DTYPES = frozenset({"bfloat16", "float16"})
DTYPE_NAMES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}


class MalformedResult(ValueError):
    """A JSON file that is not a usable result; the message is the reason shown to the user."""


@dataclass(frozen=True, kw_only=True)
class ModelKey:
    """What a record says about its model: name, training iteration, the layout or format it was
    read in (``tp2-pp2-vp1``; ``None`` for a Hugging Face directory) and the weights fingerprint."""

    name: str
    iteration: int | None
    layout: str | None
    fingerprint: str | None = None


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One task result of one run, metrics on display scale (percent for accuracy-like)."""

    path: Path
    source: str
    kind: str
    task: str
    method: str
    model: ModelKey
    parameters: int | None
    checkpoint: str | None
    metrics: Mapping[str, float]
    seed: int | None
    created: _dt.datetime
    dtype: str | None = None  # the weights' dtype during the run ("float32", "bfloat16", ...)
    limit: int | None = None  # --limit N: only the first N examples/windows (a partial result)
    sample_data: bool = False  # the built-in sample data, not the real test set
    forced_tokenizer: bool = False  # --force-tokenizer overrode a tokenizer check (model.tokenizer.forced)
    unit_rule: str = "declared"  # how accuracy-like values were scaled: "declared" or "producer"
    outputs: tuple[Path, ...] = ()  # files the run wrote beside its record (mlm-finetune predictions)

    @property
    def partial(self) -> bool:
        return self.limit is not None

    @property
    def reduced_precision(self) -> bool:
        return self.dtype in REDUCED_DTYPES


@dataclass(frozen=True, kw_only=True)
class HygieneRecord:
    """A contamination result: the share (percent) of an eval set's n-grams found in training data.

    It belongs to the model whose name or fingerprint it carries (``mlm-eval contamination --name``)."""

    path: Path
    name: str
    fingerprint: str | None
    eval_task: str
    n: int | None
    share: float
    created: _dt.datetime


@dataclass(frozen=True, kw_only=True)
class SkippedFile:
    """A JSON file that was not used, and why."""

    path: Path
    reason: str


@dataclass(frozen=True)
class Units:
    """What a record declares about its metrics' scale: a per-metric map (``units``, the current
    schema: a metric not named there is a plain value) and/or one unit for all accuracy-like
    metrics (``metric_unit``/``metric_scale``, older records)."""

    per_metric: dict[str, str] | None = None
    all_metrics: str | None = None

    @property
    def declared(self) -> bool:
        return bool(self.per_metric) or self.all_metrics is not None


def is_percent_metric(metric: str) -> bool:
    """Whether ``metric`` is accuracy-like (shown in percent, higher is better)."""
    name = metric.lower()
    return any(name == p or name.startswith(p + "_") for p in _PERCENT_PREFIXES)


def to_percent(metrics: dict[str, float], units: Units | None, producer: str) -> tuple[dict[str, float], str]:
    """Accuracy-like metrics in percent: by the metric's declared unit, else the record's, else (a
    record with a ``units`` map: a plain value) the producer's definition for older records."""
    units = units or Units()
    out: dict[str, float] = {}
    for key, value in metrics.items():
        unit = (units.per_metric or {}).get(key)
        if unit is None and is_percent_metric(key):  # older records: one unit, or the producer's
            unit = units.all_metrics or (producer if units.per_metric is None else None)
        if unit is not None and unit not in UNITS:
            raise MalformedResult(f"field 'units.{key}': expected 'percent' or 'fraction', got {unit!r}")
        out[key] = value * (100.0 if unit == "fraction" else 1.0)
    return out, "declared" if units.declared else "producer"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
