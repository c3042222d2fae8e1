"""Leaderboard columns: task families, labels, units, direction, and how values are printed.

Accuracy-like values are percent with two decimals (the paper's Table 3 precision); everything
else (perplexities, bits per byte) has four significant figures, in scientific notation from 10^4
on (``2.171e7``). A value's *reported precision* is the unit of its last printed digit: the
report calls one run better than another only when they differ by at least that much.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from mlm_eval.report.records import is_percent_metric
from pretrain.utils.results import TASK_METRICS

MISSING = "—"
SIG_FIGS = 4
PERCENT_DECIMALS = 2
HYGIENE_TASK = "contamination"  # columns: share of an eval set's n-grams in the training data
# Task families in display order, each with its tasks in order.
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Zero-shot LM", ("wikitext103", "lambada")),
    ("GLUE", ("mnli", "qqp", "cola", "sst2", "mrpc", "stsb", "qnli", "rte", "wnli")),
    ("SQuAD", ("squad1", "squad2")),
    ("RACE", ("race",)),
    ("Data hygiene", (HYGIENE_TASK,)),
)
OTHER_FAMILY = "Other"
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
    HYGIENE_TASK: "Train-data overlap",
}
METRIC_LABELS = {
    "adjusted_ppl": "adj. ppl",
    "token_ppl": "token ppl",
    "word_perplexity": "word ppl",
    "byte_perplexity": "byte ppl",
    "bits_per_byte": "bits/byte",
    "ppl": "ppl",
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
METHOD_SHORT = {"lm-eval-harness": "harness", "last-token": "last token"}
_LOWER_HINTS = ("ppl", "perplexity", "loss", "bits_per", "bpb", "error")
_PERPLEXITY_HINTS = ("ppl", "perplexity")
PLAIN_METHODS = ("paper", "")


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
    def family(self) -> str:
        return next((name for name, tasks in FAMILIES if self.task in tasks), OTHER_FAMILY)

    @property
    def task_label(self) -> str:
        return TASK_LABELS.get(self.task, self.task)

    @property
    def metric_label(self) -> str:
        if (self.task, self.metric) == ("race", "accuracy"):
            return "all acc"
        if self.task == HYGIENE_TASK:  # the metric is the eval set
            return TASK_LABELS.get(self.metric, self.metric)
        return METRIC_LABELS.get(self.metric, self.metric)

    @property
    def unit(self) -> str:
        """``%`` for accuracy-like metrics, ``ppl`` for perplexities, else empty."""
        return "%" if self.percent else ("ppl" if self.perplexity else "")

    @property
    def arrow(self) -> str:
        return "↓" if self.lower_is_better else "↑"

    @property
    def perplexity(self) -> bool:
        return any(h in self.metric.lower() for h in _PERPLEXITY_HINTS)

    @property
    def method_tag(self) -> str:
        return "" if self.method in PLAIN_METHODS else METHOD_SHORT.get(self.method, self.method)

    @property
    def header(self) -> str:
        """Metric, unit and direction, plus the method when it is not the paper's (the task is
        the group header above it)."""
        unit = " %" if self.percent else ""
        tag = f" [{self.method_tag}]" if self.method_tag else ""
        return f"{self.metric_label}{unit} {self.arrow}{tag}"

    @property
    def label(self) -> str:
        """The full one-line label (Markdown, CSV, terminal)."""
        return f"{self.task_label} {self.header}"


def column_key(task: str, metric: str, method: str) -> str:
    """``task:metric``, plus ``@method`` for a non-default method (the ``--sort-by`` syntax)."""
    return f"{task}:{metric}" if method in PLAIN_METHODS else f"{task}:{metric}@{method}"


def lower_is_better(task: str, metric: str) -> bool:
    """Known metrics from ``TASK_METRICS``; unknown ones by name (perplexities, losses)."""
    known = TASK_METRICS.get(task, {})
    if metric in known:
        return known[metric]
    return any(hint in metric.lower() for hint in _LOWER_HINTS)


def make_columns(triples: Iterable[tuple[str, str, str]]) -> tuple[Column, ...]:
    """Columns for (task, metric, method) triples: by family, task, known metric order, method."""
    task_order = [t for _, tasks in FAMILIES for t in tasks]

    def order(key: tuple[str, str, str]) -> tuple[int, str, int, str, int, str]:
        task, metric, method = key
        metrics = list(TASK_METRICS.get(task, {}))
        return (
            task_order.index(task) if task in task_order else len(task_order),
            task,
            metrics.index(metric) if metric in metrics else len(metrics),
            metric,
            0 if method in PLAIN_METHODS else 1,
            method,
        )

    return tuple(
        Column(
            task=t,
            metric=m,
            method=me,
            lower_is_better=t == HYGIENE_TASK or lower_is_better(t, m),
            percent=t == HYGIENE_TASK or is_percent_metric(m),
        )
        for t, m, me in sorted(set(triples), key=order)
    )


def quantum(value: float, *, percent: bool) -> float:
    """The unit of the last printed digit of ``value``."""
    if percent:
        return 10.0**-PERCENT_DECIMALS
    if value == 0 or not math.isfinite(value):
        return 10.0 ** -(SIG_FIGS - 1)
    return 10.0 ** (math.floor(math.log10(abs(value))) - (SIG_FIGS - 1))


def format_value(value: float | None, *, percent: bool) -> str:
    """Percent with two decimals; else four significant figures (``19.31``, ``1.600``, ``2.171e7``)."""
    if value is None or math.isnan(value):
        return MISSING
    if percent:
        return f"{value:.{PERCENT_DECIMALS}f}"
    text = f"{value:#.{SIG_FIGS}g}"
    if "e" in text:
        mantissa, _, exponent = text.partition("e")
        return f"{mantissa}e{int(exponent)}"
    return text.rstrip(".")


def meaningful_gap(best: float, runner_up: float, col: Column) -> bool:
    """Whether ``best`` beats ``runner_up`` by at least the precision either is reported with."""
    step = max(quantum(best, percent=col.percent), quantum(runner_up, percent=col.percent))
    return abs(best - runner_up) >= step * (1 - 1e-9)


def format_params(n: int | None) -> str:
    """Parameter count as 355M / 2.5B."""
    if n is None:
        return MISSING
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)
