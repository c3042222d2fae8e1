"""The official SQuAD 1.1 / 2.0 evaluation, reimplemented (``evaluate-v2.0.py`` semantics).

Scores are percentages. 1.1 is the special case without unanswerable questions: for answerable
questions both scripts agree (max over gold answers of exact match and token F1 after
normalisation). For 2.0 an unanswerable question scores 1 only for an empty prediction, and the
result has the ``HasAns_*`` / ``NoAns_*`` breakdown; with no-answer probabilities it also reports
the best threshold (``best_f1_thresh``).
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower case, drop punctuation, drop articles a/an/the, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def get_tokens(s: str) -> list[str]:
    return normalize_answer(s).split() if s else []


def compute_exact(gold: str, pred: str) -> int:
    return int(normalize_answer(gold) == normalize_answer(pred))


def compute_f1(gold: str, pred: str) -> float:
    """Token-overlap F1; when either side is empty it is 1 if both are, else 0."""
    gold_toks, pred_toks = get_tokens(gold), get_tokens(pred)
    if not gold_toks or not pred_toks:
        return float(gold_toks == pred_toks)
    common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(pred_toks), num_same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True, kw_only=True)
class GoldQuestion:
    """The gold side of one question: answer texts (empty tuple = unanswerable)."""

    qid: str
    answers: tuple[str, ...]

    @property
    def has_answer(self) -> bool:
        return bool(self.answers)


def raw_scores(
    golds: Sequence[GoldQuestion], preds: Mapping[str, str]
) -> tuple[dict[str, int], dict[str, float]]:
    """Per-question exact and F1 (0/1 scale), max over gold answers; missing predictions score 0."""
    exact: dict[str, int] = {}
    f1: dict[str, float] = {}
    for g in golds:
        # As the official script: answers that normalise to nothing count as "no answer".
        answers = [a for a in g.answers if normalize_answer(a)] or [""]
        if g.qid not in preds:
            exact[g.qid], f1[g.qid] = 0, 0.0
            continue
        pred = preds[g.qid]
        exact[g.qid] = max(compute_exact(a, pred) for a in answers)
        f1[g.qid] = max(compute_f1(a, pred) for a in answers)
    return exact, f1


def apply_no_answer_threshold(
    scores: Mapping[str, float], na_probs: Mapping[str, float], has_ans: Mapping[str, bool], thresh: float
) -> dict[str, float]:
    """Scores when every question whose no-answer probability exceeds ``thresh`` predicts empty."""
    return {
        qid: (float(not has_ans[qid]) if na_probs.get(qid, 0.0) > thresh else float(s))
        for qid, s in scores.items()
    }


def find_best_thresh(
    preds: Mapping[str, str],
    scores: Mapping[str, float],
    na_probs: Mapping[str, float],
    has_ans: Mapping[str, bool],
) -> tuple[float, float]:
    """The official sweep: best total score (percent) and the no-answer threshold achieving it."""
    cur = best = float(sum(1 for v in has_ans.values() if not v))
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        if has_ans[qid]:
            diff = scores[qid]
        elif preds.get(qid, ""):
            diff = -1.0
        else:
            diff = 0.0
        cur += diff
        if cur > best:
            best, best_thresh = cur, na_probs[qid]
    return 100.0 * best / len(scores), best_thresh


def _mean(values: Mapping[str, float], qids: Sequence[str]) -> float:
    return 100.0 * sum(values[q] for q in qids) / len(qids)


def squad_evaluate(
    golds: Sequence[GoldQuestion],
    preds: Mapping[str, str],
    *,
    na_probs: Mapping[str, float] | None = None,
    na_prob_thresh: float = 1.0,
) -> dict[str, float]:
    """Official scores: ``exact_match``, ``f1`` (percent) and ``total``.

    When some question is unanswerable (SQuAD 2.0) also ``HasAns_exact``/``HasAns_f1``/
    ``HasAns_total`` and the ``NoAns_`` equivalents; with ``na_probs`` (qid -> no-answer
    probability or score) also ``best_exact``, ``best_exact_thresh``, ``best_f1``,
    ``best_f1_thresh``. Questions above ``na_prob_thresh`` count as predicted empty. Unlike
    ``evaluate-v2.0.py`` (which drops them from the average) a missing prediction scores 0, as in
    ``evaluate-v1.1.py``.
    """
    if not golds:
        return {"exact_match": 0.0, "f1": 0.0, "total": 0}
    has_ans = {g.qid: g.has_answer for g in golds}
    exact_raw, f1_raw = raw_scores(golds, preds)
    exact = apply_no_answer_threshold(exact_raw, na_probs or {}, has_ans, na_prob_thresh)
    f1 = apply_no_answer_threshold(f1_raw, na_probs or {}, has_ans, na_prob_thresh)
    qids = [g.qid for g in golds]
    out: dict[str, float] = {"exact_match": _mean(exact, qids), "f1": _mean(f1, qids), "total": len(qids)}
    has, no = [q for q in qids if has_ans[q]], [q for q in qids if not has_ans[q]]
    if no:  # a SQuAD 2.0 set
        for prefix, subset in (("HasAns", has), ("NoAns", no)):
            if subset:
                out[f"{prefix}_exact"] = _mean(exact, subset)
                out[f"{prefix}_f1"] = _mean(f1, subset)
                out[f"{prefix}_total"] = len(subset)
    if na_probs is not None:
        out["best_exact"], out["best_exact_thresh"] = find_best_thresh(preds, exact_raw, na_probs, has_ans)
        out["best_f1"], out["best_f1_thresh"] = find_best_thresh(preds, f1_raw, na_probs, has_ans)
    return out
