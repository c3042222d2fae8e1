"""GLUE metrics against hand-computed values and scipy; per-task official metric sets."""

from __future__ import annotations

import math

import numpy as np
import pytest

from finetune.metrics import (
    GLUE_METRICS,
    accuracy,
    binary_f1,
    glue_task_metrics,
    matthews_corrcoef,
    pearson,
    spearman,
)
from pretrain.utils.errors import UserError

PRED = [1, 1, 0, 0, 1]
GOLD = [1, 0, 0, 1, 1]  # tp 2, fp 1, fn 1, tn 1


def test_accuracy_f1_mcc_hand_computed() -> None:
    assert accuracy(PRED, GOLD) == pytest.approx(3 / 5)
    assert binary_f1(PRED, GOLD) == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))  # 0.6667
    # (tp*tn - fp*fn) / sqrt((tp+fp)(tp+fn)(tn+fp)(tn+fn)) = (2 - 1) / sqrt(3*3*2*2) = 1/6
    assert matthews_corrcoef(PRED, GOLD) == pytest.approx(1 / 6)
    assert matthews_corrcoef([1, 0, 1], [1, 0, 1]) == pytest.approx(1.0)
    assert matthews_corrcoef([0, 1, 0], [1, 0, 1]) == pytest.approx(-1.0)
    assert matthews_corrcoef([1, 1, 1], [1, 0, 1]) == 0.0  # constant prediction: undefined -> 0
    assert binary_f1([0, 0], [0, 0]) == 0.0  # no positives at all


def test_pearson_spearman_hand_computed() -> None:
    # dx = [-1.5,-.5,.5,1.5], dy = [-3,-1,0,4]: r = 11 / sqrt(5 * 26)
    assert pearson([1, 2, 3, 4], [2, 4, 5, 9]) == pytest.approx(11 / math.sqrt(130))
    # ties get average ranks: x -> [1, 2.5, 2.5, 4], y -> [1, 3, 2, 4]; r = 4.5 / sqrt(4.5 * 5)
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(22.5))
    assert spearman([1, 2, 3, 4], [1, 4, 9, 16]) == pytest.approx(1.0)  # monotone, not linear
    assert pearson([1, 2, 3, 4], [1, 4, 9, 16]) < 0.99
    assert pearson([1, 1, 1], [1, 2, 3]) == 0.0


def test_against_scipy_on_random_data() -> None:
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    x = rng.normal(size=200)
    y = 0.6 * x + rng.normal(size=200)
    assert pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-12)
    xr, yr = np.round(x, 1), np.round(y, 0)  # many ties
    assert spearman(xr, yr) == pytest.approx(stats.spearmanr(xr, yr)[0], abs=1e-12)
    a, b = rng.integers(0, 3, 300), rng.integers(0, 3, 300)
    b[:150] = a[:150]
    # Multi-class MCC (Gorodkin R_K) via its covariance definition on one-hot indicator matrices.
    ia, ib = np.eye(3)[a], np.eye(3)[b]
    ca, cb = ia - ia.mean(0), ib - ib.mean(0)
    expected = (ca * cb).sum() / math.sqrt((ca * ca).sum() * (cb * cb).sum())
    assert matthews_corrcoef(a, b) == pytest.approx(expected, abs=1e-12)


def test_task_metric_sets_are_scaled_to_percent() -> None:
    assert GLUE_METRICS["cola"] == ("mcc",)
    assert glue_task_metrics("cola", PRED, GOLD) == pytest.approx({"mcc": 100 / 6})
    assert glue_task_metrics("mrpc", PRED, GOLD) == pytest.approx({"accuracy": 60.0, "f1": 200 / 3})
    assert glue_task_metrics("qqp", PRED, GOLD, scale=1.0) == pytest.approx({"accuracy": 0.6, "f1": 2 / 3})
    s = glue_task_metrics("stsb", [1, 2, 2, 3], [1, 3, 2, 4])
    assert set(s) == {"pearson", "spearman"} and s["spearman"] == pytest.approx(100 * 4.5 / math.sqrt(22.5))
    assert glue_task_metrics("rte", [0, 1], [0, 0]) == {"accuracy": 50.0}
    with pytest.raises(UserError, match="unknown GLUE task"):
        glue_task_metrics("squad", [1], [1])
    with pytest.raises(UserError, match="same length"):
        accuracy([1, 2], [1])
    with pytest.raises(UserError, match="zero examples"):
        accuracy([], [])
