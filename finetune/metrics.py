"""GLUE / RACE classification and regression metrics in numpy, and each GLUE task's official set.

The single-metric functions return fractions (accuracy in [0, 1], correlations in [-1, 1]);
:func:`glue_task_metrics` scales them by 100 (``scale``), as the GLUE leaderboard and the paper
report them. Metric names are those of ``pretrain.utils.results.TASK_METRICS``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import ArrayLike

from pretrain.utils.errors import UserError

# The official GLUE metric set of each task (MNLI is scored on dev_matched and dev_mismatched;
# glue.evaluate_glue adds the "_m"/"_mm" suffixes).
GLUE_METRICS: dict[str, tuple[str, ...]] = {
    "cola": ("mcc",),
    "sst2": ("accuracy",),
    "mrpc": ("accuracy", "f1"),
    "qqp": ("accuracy", "f1"),
    "stsb": ("pearson", "spearman"),
    "mnli": ("accuracy",),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
    "wnli": ("accuracy",),
}


def _pair(predictions: ArrayLike, labels: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    p, y = np.asarray(predictions), np.asarray(labels)
    if p.shape != y.shape or p.ndim != 1:
        raise UserError(f"predictions {p.shape} and labels {y.shape} must be 1-D of the same length")
    if p.size == 0:
        raise UserError("cannot compute a metric over zero examples")
    return p, y


def accuracy(predictions: ArrayLike, labels: ArrayLike) -> float:
    """Fraction of predictions equal to the label."""
    p, y = _pair(predictions, labels)
    return float(np.mean(p == y))


def binary_f1(predictions: ArrayLike, labels: ArrayLike, positive: int = 1) -> float:
    """F1 of the ``positive`` class; 0 when there are no true positives (sklearn's convention)."""
    p, y = _pair(predictions, labels)
    tp = float(np.sum((p == positive) & (y == positive)))
    fp = float(np.sum((p == positive) & (y != positive)))
    fn = float(np.sum((p != positive) & (y == positive)))
    if tp == 0.0:
        return 0.0
    return 2.0 * tp / (2.0 * tp + fp + fn)


def matthews_corrcoef(predictions: ArrayLike, labels: ArrayLike) -> float:
    """Matthews correlation of binary (or multi-class, Gorodkin's R_K) predictions; 0 if undefined."""
    p, y = _pair(predictions, labels)
    classes = np.unique(np.concatenate([p, y]))
    conf = np.array([[np.sum((y == a) & (p == b)) for b in classes] for a in classes], dtype=np.float64)
    t, pk = conf.sum(axis=1), conf.sum(axis=0)  # true and predicted counts per class
    c, s = np.trace(conf), conf.sum()
    denom = np.sqrt((s * s - pk @ pk) * (s * s - t @ t))
    return 0.0 if denom == 0.0 else float((c * s - t @ pk) / denom)


def pearson(predictions: ArrayLike, labels: ArrayLike) -> float:
    """Pearson correlation; 0 when either side is constant (undefined)."""
    p, y = _pair(predictions, labels)
    pc, yc = p.astype(np.float64) - p.mean(), y.astype(np.float64) - y.mean()
    denom = np.sqrt((pc @ pc) * (yc @ yc))
    return 0.0 if denom == 0.0 else float((pc @ yc) / denom)


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks with ties given their average rank (scipy.stats.rankdata 'average')."""
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    # Boundaries of runs of equal values in the sorted array.
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], len(x)]
    ranks = np.empty(len(x), dtype=np.float64)
    for s, e in zip(starts, ends, strict=True):
        ranks[order[s:e]] = (s + 1 + e) / 2.0
    return ranks


def spearman(predictions: ArrayLike, labels: ArrayLike) -> float:
    """Spearman rank correlation (Pearson of average ranks, as scipy.stats.spearmanr)."""
    p, y = _pair(predictions, labels)
    return pearson(_average_ranks(p.astype(np.float64)), _average_ranks(y.astype(np.float64)))


METRIC_FUNCTIONS: dict[str, Callable[[ArrayLike, ArrayLike], float]] = {
    "accuracy": accuracy,
    "f1": binary_f1,
    "mcc": matthews_corrcoef,
    "pearson": pearson,
    "spearman": spearman,
}


def glue_task_metrics(
    task: str,
    predictions: Sequence[float] | ArrayLike,
    labels: Sequence[float] | ArrayLike,
    *,
    scale: float = 100.0,
) -> dict[str, float]:
    """The official metrics of GLUE ``task`` (class ids, or scores for STS-B), times ``scale``."""
    if task not in GLUE_METRICS:
        raise UserError(f"unknown GLUE task {task!r}; expected one of {', '.join(GLUE_METRICS)}")
    return {name: scale * METRIC_FUNCTIONS[name](predictions, labels) for name in GLUE_METRICS[task]}
