"""SQuAD 1.1 / 2.0 data: official JSON and Hugging Face ``squad``/``squad_v2``, and windowed features.

A feature is ``[CLS] question [SEP] context-window [SEP]``. Contexts longer than the room left by
the question are split into windows; consecutive windows start ``doc_stride`` tokens apart
(Google BERT's ``run_squad.py`` meaning of the stride). Every context token keeps its character
offsets into the original context, so predicted spans map back to the exact original text.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.squad_metrics import GoldQuestion
from finetune.tokenization import Offset, PairEncoder
from pretrain.utils.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SquadAnswer:
    text: str
    start: int  # character offset in the context


@dataclass(frozen=True, kw_only=True)
class SquadExample:
    """One question; ``answers`` is empty for an unanswerable (2.0) question."""

    qid: str
    title: str
    question: str
    context: str
    answers: tuple[SquadAnswer, ...]
    is_impossible: bool = False
    source: str = ""

    def gold(self) -> GoldQuestion:
        return GoldQuestion(
            qid=self.qid, answers=() if self.is_impossible else tuple(a.text for a in self.answers)
        )


def _field(obj: Any, key: str, kind: type, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise UserError(f"{where}: missing field {key!r}")
    if not isinstance(obj[key], kind):
        raise UserError(f"{where}.{key}: expected {kind.__name__}, got {type(obj[key]).__name__}")
    return obj[key]


def _parse_answers(qa: dict[str, Any], context: str, where: str) -> tuple[SquadAnswer, ...]:
    answers = []
    for k, ans in enumerate(_field(qa, "answers", list, where)):
        aw = f"{where}.answers[{k}]"
        text, start = _field(ans, "text", str, aw), _field(ans, "answer_start", int, aw)
        if not 0 <= start <= len(context) - len(text):
            raise UserError(f"{aw}.answer_start: {start} is outside the context ({len(context)} characters)")
        answers.append(SquadAnswer(text=text, start=start))
    return tuple(answers)


def read_squad_json(path: str | os.PathLike[str]) -> list[SquadExample]:
    """Read an official SQuAD 1.1 or 2.0 JSON file (``data -> paragraphs -> qas``)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"SQuAD file {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    examples = []
    for i, article in enumerate(_field(doc, "data", list, str(path))):
        aw = f"{path}: data[{i}]"
        title = article.get("title", "") if isinstance(article, dict) else ""
        for j, para in enumerate(_field(article, "paragraphs", list, aw)):
            pw = f"{aw}.paragraphs[{j}]"
            context = _field(para, "context", str, pw)
            for k, qa in enumerate(_field(para, "qas", list, pw)):
                qw = f"{pw}.qas[{k}]"
                impossible = bool(qa.get("is_impossible", False)) if isinstance(qa, dict) else False
                answers = _parse_answers(qa, context, qw)
                if not impossible and not answers:
                    raise UserError(f"{qw}: answerable question without answers")
                examples.append(
                    SquadExample(
                        qid=str(_field(qa, "id", str, qw)),
                        title=title,
                        question=_field(qa, "question", str, qw),
                        context=context,
                        answers=() if impossible else answers,
                        is_impossible=impossible,
                        source=qw,
                    )
                )
    return examples


def read_squad_hf(dataset: Iterable[dict[str, Any]]) -> list[SquadExample]:
    """Examples from one split of HF ``squad`` / ``squad_v2`` (empty answers = unanswerable)."""
    out = []
    for i, rec in enumerate(dataset):
        where = f"hf:squad:{i}"
        texts, starts = rec["answers"]["text"], rec["answers"]["answer_start"]
        answers = tuple(SquadAnswer(text=t, start=int(s)) for t, s in zip(texts, starts, strict=True))
        out.append(
            SquadExample(
                qid=str(rec["id"]),
                title=rec.get("title", ""),
                question=rec["question"],
                context=rec["context"],
                answers=answers,
                is_impossible=not answers,
                source=where,
            )
        )
    return out


@dataclass(frozen=True, kw_only=True)
class SquadFeatureConfig:
    """Window geometry (BERT's defaults)."""

    max_seq_length: int = 384
    doc_stride: int = 128
    max_query_length: int = 64


@dataclass(frozen=True, kw_only=True)
class SquadFeature:
    """One window of one example; per-token lists have length ``max_seq_length``.

    ``offsets[i]`` is the ``(start, end)`` character span in the context of token ``i`` when it
    is a context token, else ``None`` (``[CLS]``, question, ``[SEP]``, padding). The window's
    context tokens sit at positions ``context_start ...`` and are tokens ``doc_offset ...
    doc_offset + doc_length - 1`` of the whole context (post-processing uses this to score a span
    only in the window that sees it with most context).
    ``start_position``/``end_position`` are the gold token span, 0/0 (``[CLS]``) when the answer is
    not inside this window or the question is unanswerable.
    """

    example_index: int
    qid: str
    window_index: int
    input_ids: list[int]
    token_type_ids: list[int]
    attention_mask: list[int]
    offsets: list[Offset | None]
    context_start: int
    doc_offset: int
    doc_length: int
    start_position: int
    end_position: int


def _doc_spans(num_tokens: int, window: int, stride: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each window over ``num_tokens`` context tokens."""
    spans, start = [], 0
    while True:
        length = min(window, num_tokens - start)
        spans.append((start, length))
        if start + length >= num_tokens:
            return spans
        start += min(length, stride)


def char_span_to_tokens(offsets: Sequence[Offset], start: int, end: int) -> tuple[int, int] | None:
    """First and last token overlapping characters ``[start, end)``; ``None`` if no token does."""
    inside = [i for i, (s, e) in enumerate(offsets) if s < end and e > start]
    return (inside[0], inside[-1]) if inside else None


def _answer_tokens(example: SquadExample, offsets: Sequence[Offset]) -> tuple[int, int] | None:
    if example.is_impossible or not example.answers:
        return None
    ans = example.answers[0]
    actual = example.context[ans.start : ans.start + len(ans.text)]
    if " ".join(actual.split()) != " ".join(ans.text.split()):
        log.warning(
            "%s: answer %r does not match the context at %d (%r); skipped",
            example.source,
            ans.text,
            ans.start,
            actual,
        )
        return None
    return char_span_to_tokens(offsets, ans.start, ans.start + len(ans.text))


def build_squad_features(
    examples: Sequence[SquadExample], encoder: PairEncoder, config: SquadFeatureConfig, *, is_training: bool
) -> list[SquadFeature]:
    """Windowed features of ``examples``.

    With ``is_training`` an answerable example whose answer text does not match its context
    (a handful exist in SQuAD train) yields no feature, as in BERT's ``run_squad.py``.
    """
    if encoder.max_seq_length != config.max_seq_length:
        raise UserError(
            f"encoder max_seq_length {encoder.max_seq_length} != SQuAD max_seq_length {config.max_seq_length}"
        )
    features = []
    for ex_index, ex in enumerate(examples):
        q_ids = encoder.tokenize(ex.question)[: config.max_query_length]
        ctx_ids, ctx_offsets = encoder.tokenize_with_offsets(ex.context)
        window = config.max_seq_length - len(q_ids) - 3
        if window <= 0:
            raise UserError(
                f"--seq-length {config.max_seq_length} leaves no room for the context after the question"
            )
        gold = _answer_tokens(ex, ctx_offsets)
        if is_training and not ex.is_impossible and gold is None:
            continue
        spans = _doc_spans(len(ctx_ids), window, config.doc_stride)
        for w, (start, length) in enumerate(spans):
            enc = encoder.encode_ids(q_ids, ctx_ids[start : start + length])
            b0 = enc.b_start
            offsets: list[Offset | None] = [None] * config.max_seq_length
            offsets[b0 : b0 + length] = ctx_offsets[start : start + length]
            s_pos = e_pos = 0
            if gold is not None and start <= gold[0] and gold[1] < start + length:
                s_pos, e_pos = gold[0] - start + b0, gold[1] - start + b0
            features.append(
                SquadFeature(
                    example_index=ex_index,
                    qid=ex.qid,
                    window_index=w,
                    input_ids=enc.input_ids,
                    token_type_ids=enc.token_type_ids,
                    attention_mask=enc.attention_mask,
                    offsets=offsets,
                    context_start=b0,
                    doc_offset=start,
                    doc_length=length,
                    start_position=s_pos,
                    end_position=e_pos,
                )
            )
    return features
