"""RACE reading comprehension: official directory layout, four encodings per question, accuracy.

Layout: ``RACE/{train,dev,test}/{high,middle}/*.txt``, each file one JSON object with ``article``,
``questions``, ``options`` (four per question) and ``answers`` (letters A-D).

Inputs follow upstream Megatron ``tasks/race/data.py``: for each option, ``qa`` is the question
with ``_`` replaced by the option when it has one, else ``question + " " + option``; ``qa`` is
cut to ``max_qa_length`` (128) tokens and is segment A, the article is segment B, and the pair is
truncated by cutting the end of the article (``truncation="cap"``). Both texts go through
Megatron's ``clean_text``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from finetune.metrics import accuracy
from finetune.tokenization import PairEncoder, PairEncoding, clean_text
from pretrain.utils.errors import UserError

NUM_CHOICES = 4
MAX_QA_LENGTH = 128
SUBSETS = ("middle", "high")
SPLITS = ("train", "dev", "test")


@dataclass(frozen=True, kw_only=True)
class RaceExample:
    """One question with its four options; ``label`` 0-3 (A-D)."""

    uid: str  # "<subset>/<file stem>/<question index>"
    subset: str  # "middle" or "high"
    article: str
    question: str
    options: tuple[str, ...]
    label: int


@dataclass(frozen=True, kw_only=True)
class RaceFeature:
    """The four encodings of one question (one per option) and its label."""

    uid: str
    subset: str
    choices: tuple[PairEncoding, ...]
    label: int


def qa_text(question: str, option: str) -> str:
    """Question with ``_`` filled by the option (cloze), else question + " " + option."""
    return question.replace("_", option) if "_" in question else f"{question} {option}"


def _load_file(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: expected a JSON object with article/questions/options/answers")
    for key, kind in (("article", str), ("questions", list), ("options", list), ("answers", list)):
        if not isinstance(doc.get(key), kind):
            raise UserError(f"{path}: field {key!r} missing or not a {kind.__name__}")
    n = len(doc["questions"])
    if len(doc["options"]) != n or len(doc["answers"]) != n:
        raise UserError(
            f"{path}: {n} questions but {len(doc['options'])} option lists and {len(doc['answers'])} answers"
        )
    return doc


def _examples_of_file(path: Path, subset: str) -> list[RaceExample]:
    doc = _load_file(path)
    out = []
    for i, (question, options, answer) in enumerate(
        zip(doc["questions"], doc["options"], doc["answers"], strict=True)
    ):
        if not isinstance(options, list) or len(options) != NUM_CHOICES:
            raise UserError(f"{path}: options[{i}] must be a list of {NUM_CHOICES} strings")
        if not isinstance(answer, str) or len(answer) != 1 or not 0 <= ord(answer) - ord("A") < NUM_CHOICES:
            raise UserError(f"{path}: answers[{i}] is {answer!r}, expected one of A, B, C, D")
        out.append(
            RaceExample(
                uid=f"{subset}/{path.stem}/{i}",
                subset=subset,
                article=doc["article"],
                question=str(question),
                options=tuple(str(o) for o in options),
                label=ord(answer) - ord("A"),
            )
        )
    return out


def read_race(
    data_dir: str | os.PathLike[str], split: str, subsets: Sequence[str] = SUBSETS
) -> list[RaceExample]:
    """All questions of ``split`` (``train``/``dev``/``test``) in ``data_dir`` for the given subsets."""
    if split not in SPLITS:
        raise UserError(f"RACE split {split!r}: expected one of {', '.join(SPLITS)}")
    examples: list[RaceExample] = []
    for subset in subsets:
        sub_dir = Path(data_dir) / split / subset
        if not sub_dir.is_dir():
            raise UserError(f"--data-dir {data_dir}: missing RACE directory {sub_dir}")
        files = sorted(p for p in sub_dir.iterdir() if p.is_file() and not p.name.startswith("."))
        if not files:
            raise UserError(f"RACE directory {sub_dir} holds no files")
        for path in files:
            examples += _examples_of_file(path, subset)
    return examples


def build_race_features(
    examples: Sequence[RaceExample], encoder: PairEncoder, *, max_qa_length: int = MAX_QA_LENGTH
) -> list[RaceFeature]:
    """Four ``[CLS] qa [SEP] article [SEP]`` encodings per question (article tokenized once)."""
    features = []
    article_ids: dict[str, list[int]] = {}  # the questions of one file share the article
    for ex in examples:
        if ex.article not in article_ids:
            article_ids = {ex.article: encoder.tokenize(clean_text(ex.article))}
        ctx = article_ids[ex.article]
        choices = tuple(
            encoder.encode_ids(
                encoder.tokenize(clean_text(qa_text(ex.question, o)))[:max_qa_length], ctx, truncation="cap"
            )
            for o in ex.options
        )
        features.append(RaceFeature(uid=ex.uid, subset=ex.subset, choices=choices, label=ex.label))
    return features


def race_accuracy(
    subsets: Sequence[str], predictions: ArrayLike, labels: ArrayLike, *, scale: float = 100.0
) -> dict[str, float]:
    """``accuracy_middle``, ``accuracy_high`` (for subsets present) and overall ``accuracy``."""
    preds, golds, subs = np.asarray(predictions), np.asarray(labels), np.asarray(subsets)
    if not (len(subs) == len(preds) == len(golds)):
        raise UserError(f"RACE: {len(subs)} subsets, {len(preds)} predictions, {len(golds)} labels")
    out: dict[str, float] = {}
    for subset in SUBSETS:
        mask = subs == subset
        if mask.any():
            out[f"accuracy_{subset}"] = scale * accuracy(preds[mask], golds[mask])
    out["accuracy"] = scale * accuracy(preds, golds)
    return out
