"""SQuAD answer post-processing: start/end logits of every window -> answer text per question.

As BERT's ``run_squad.py``: per window the ``n_best_size`` top start and end positions are
paired; spans that start or end outside the context (question, ``[SEP]``, padding), end before
they start, or are longer than ``max_answer_length`` tokens are dropped. So is a span that another
window holding it sees with more context (``min(left, right)`` context tokens): BERT's
``_check_is_max_context`` applied to the whole span rather than to its start token alone, since
BERT's rule can pick a window that cuts the answer and then never predicts it. The text is the
original context slice from the first token's start to the last token's end character. For
SQuAD 2.0 the null score (``[CLS]`` start + end, lowest over the windows) is compared with the
best span: ``null - best > threshold`` predicts "".
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike

from finetune.squad import SquadExample, SquadFeature
from pretrain.utils.atomic import atomic_open
from pretrain.utils.errors import UserError


@dataclass(frozen=True, kw_only=True)
class SquadPostprocessConfig:
    n_best_size: int = 20
    max_answer_length: int = 30
    version_2_with_negative: bool = False
    null_score_diff_threshold: float = 0.0


@dataclass(frozen=True, kw_only=True)
class NbestEntry:
    text: str
    start_logit: float
    end_logit: float
    probability: float = 0.0


@dataclass(frozen=True, kw_only=True)
class SquadPredictions:
    """``predictions``: qid -> answer text ("" = no answer); ``null_odds``: qid -> null score minus
    best span score (2.0 only; the official evaluator's ``na_prob_file``)."""

    predictions: dict[str, str]
    null_odds: dict[str, float] = field(default_factory=dict)
    nbest: dict[str, list[NbestEntry]] = field(default_factory=dict)


def _top(logits: np.ndarray, n: int) -> list[int]:
    return [int(i) for i in np.argsort(-logits, kind="stable")[:n]]


def _best_window(windows: Sequence[SquadFeature], first: int, last: int) -> int:
    """Index in ``windows`` of the one holding context tokens first..last with most context."""
    best, best_score = -1, -1.0
    for i, w in enumerate(windows):
        end = w.doc_offset + w.doc_length - 1
        if w.doc_offset <= first and last <= end:
            score = min(first - w.doc_offset, end - last) + 0.01 * w.doc_length
            if score > best_score:
                best, best_score = i, score
    return best


def _window_candidates(
    context: str,
    windows: Sequence[SquadFeature],
    k: int,
    start: np.ndarray,
    end: np.ndarray,
    cfg: SquadPostprocessConfig,
) -> list[tuple[float, NbestEntry]]:
    feat, out = windows[k], []
    for s in _top(start, cfg.n_best_size):
        for e in _top(end, cfg.n_best_size):
            so, eo = feat.offsets[s], feat.offsets[e]
            if so is None or eo is None or e < s or e - s + 1 > cfg.max_answer_length:
                continue
            shift = feat.doc_offset - feat.context_start
            if len(windows) > 1 and _best_window(windows, s + shift, e + shift) != k:
                continue
            entry = NbestEntry(
                text=context[so[0] : eo[1]], start_logit=float(start[s]), end_logit=float(end[e])
            )
            out.append((float(start[s] + end[e]), entry))
    return out


def _with_probabilities(entries: list[NbestEntry]) -> list[NbestEntry]:
    scores = [e.start_logit + e.end_logit for e in entries]
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [
        NbestEntry(text=e.text, start_logit=e.start_logit, end_logit=e.end_logit, probability=x / total)
        for e, x in zip(entries, exps, strict=True)
    ]


def _group_features(features: Sequence[SquadFeature]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, f in enumerate(features):
        groups.setdefault(f.example_index, []).append(i)
    return groups


def postprocess_squad(
    examples: Sequence[SquadExample],
    features: Sequence[SquadFeature],
    start_logits: ArrayLike,
    end_logits: ArrayLike,
    config: SquadPostprocessConfig,
) -> SquadPredictions:
    """Answer text per question from ``[num_features, seq_len]`` start and end logits."""
    starts, ends = np.asarray(start_logits, dtype=np.float64), np.asarray(end_logits, dtype=np.float64)
    if starts.shape != ends.shape or starts.ndim != 2 or starts.shape[0] != len(features):
        raise UserError(f"SQuAD logits {starts.shape}/{ends.shape} do not match {len(features)} features")
    groups = _group_features(features)
    result = SquadPredictions(predictions={})
    for ex_index, ex in enumerate(examples):
        cands: list[tuple[float, NbestEntry]] = []
        null: tuple[float, float] | None = None  # (start, end) logit of [CLS] in the lowest-null window
        indices = groups.get(ex_index, [])
        windows = [features[fi] for fi in indices]
        for k, fi in enumerate(indices):
            s, e = starts[fi], ends[fi]
            cands += _window_candidates(ex.context, windows, k, s, e, config)
            if null is None or s[0] + e[0] < sum(null):
                null = (float(s[0]), float(e[0]))
        cands.sort(key=lambda c: c[0], reverse=True)
        nbest: list[NbestEntry] = []
        for _, entry in cands:
            if len(nbest) >= config.n_best_size:
                break
            if entry.text not in {n.text for n in nbest}:
                nbest.append(entry)
        best = nbest[0] if nbest else None
        if config.version_2_with_negative and null is not None:
            nbest.append(NbestEntry(text="", start_logit=null[0], end_logit=null[1]))
            diff = sum(null) - (best.start_logit + best.end_logit) if best else math.inf
            result.null_odds[ex.qid] = diff
            answer = "" if best is None or diff > config.null_score_diff_threshold else best.text
        else:
            answer = best.text if best else ""
        result.predictions[ex.qid] = answer
        if nbest:
            result.nbest[ex.qid] = _with_probabilities(
                sorted(nbest, key=lambda n: -(n.start_logit + n.end_logit))
            )
    return result


def _write_json(path: str | os.PathLike[str], obj: object) -> Path:
    path = Path(path)
    with atomic_open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    return path


def write_squad_predictions(path: str | os.PathLike[str], predictions: Mapping[str, str]) -> Path:
    """The official predictions file ``{qid: answer text}`` (2.0: "" for no answer)."""
    return _write_json(path, dict(predictions))


def write_null_odds(path: str | os.PathLike[str], null_odds: Mapping[str, float]) -> Path:
    """The official evaluator's ``--na-prob-file`` (``{qid: null score - best span score}``)."""
    return _write_json(path, {k: (v if math.isfinite(v) else 1e9) for k, v in null_odds.items()})


def write_nbest(path: str | os.PathLike[str], nbest: Mapping[str, Sequence[NbestEntry]]) -> Path:
    """``nbest_predictions.json`` as BERT writes it (text, probability, start/end logit)."""
    return _write_json(
        path,
        {
            qid: [
                {
                    "text": n.text,
                    "probability": n.probability,
                    "start_logit": n.start_logit,
                    "end_logit": n.end_logit,
                }
                for n in entries
            ]
            for qid, entries in nbest.items()
        },
    )
