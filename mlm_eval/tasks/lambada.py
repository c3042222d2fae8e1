"""LAMBADA cloze accuracy (paper appendix E.2) and the upstream single-token variant.

Strict (the paper's, Megatron-LM ``--strict-lambada``): the target is the last whitespace word
with a leading space, tokenized on its own into subword tokens; the context is the text before
it, stripped and tokenized on its own. An example is correct only if, under teacher forcing, every
target token is the argmax. Last-token (upstream's default, ``--last-token``): the whole text is
tokenized and only its last subword token is the target.

Perplexities: ``ppl`` = exp(-mean over examples of the summed target log-probability), the
lm-evaluation-harness ``lambada`` perplexity; ``token_ppl`` = exp(NLL summed over all target
tokens / number of target tokens).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from mlm_eval.scoring.scorer import (
    IGNORE,
    LMScorer,
    TextEncoder,
    as_text_encoder,
    document_prefix,
    score_rows,
)
from pretrain.utils.errors import UserError
from pretrain.utils.jsonl import iter_json_objects, string_field


@dataclass(frozen=True, kw_only=True)
class LambadaScore:
    """The outcome of one example."""

    nll: float  # summed over the target tokens
    target_tokens: int
    correct: bool
    truncated: bool  # context cut on the left to fit the model


def read_lambada_jsonl(path: str | os.PathLike[str]) -> list[str]:
    """Read ``{"text": ...}`` lines (blank lines skipped); errors name the file and line."""
    texts: list[str] = []
    for lineno, record in iter_json_objects(path):
        text = string_field(record, "text", source=path, line=lineno)
        if len(text.split()) < 2:
            raise UserError(f"{path}:{lineno}: text needs a context and a last word, got {text!r}")
        texts.append(text)
    if not texts:
        raise UserError(f"{path}: no LAMBADA examples")
    return texts


def split_example(encoder: TextEncoder, text: str, *, strict: bool) -> tuple[list[int], list[int]]:
    """(context ids, target ids) of one example (see the module docstring)."""
    if strict:
        last_word = text.split()[-1]
        context = text[: text.rfind(last_word)].strip()
        return encoder.encode(context), encoder.encode(" " + last_word)
    tokens = encoder.encode(text)
    return tokens[:-1], tokens[-1:]


def _example_row(context: list[int], target: list[int], max_length: int) -> tuple[list[int], list[int], bool]:
    """Scorer row (inputs, targets) for one example; the context is cut on the left to fit."""
    sequence = context + target
    truncated = len(sequence) - 1 > max_length
    sequence = sequence[-(max_length + 1) :]
    inputs = sequence[:-1]
    return inputs, [IGNORE] * (len(inputs) - len(target)) + target, truncated


def score_lambada(
    scorer: LMScorer,
    tokenizer: Any,
    examples: list[str],
    *,
    strict: bool = True,
    batch_size: int = 8,
    progress: bool = True,
) -> list[LambadaScore]:
    """Score every example; the per-example outcomes behind :func:`evaluate_lambada`."""
    encoder = as_text_encoder(tokenizer)
    bos = document_prefix(encoder)  # [BOS] before each passage for a BOS-adding tokenizer (Llama)
    rows, truncated = [], []
    for i, text in enumerate(examples):
        context, target = split_example(encoder, text, strict=strict)
        context = bos + context if context else context
        if not context or not target:
            raise UserError(f"LAMBADA example {i + 1}: no context before the target in {text!r}")
        if len(target) > scorer.max_length:
            raise UserError(f"LAMBADA example {i + 1}: target of {len(target)} tokens exceeds the model")
        inputs, targets, cut = _example_row(context, target, scorer.max_length)
        rows.append((inputs, targets))
        truncated.append(cut)
    scored = score_rows(scorer, rows, batch_size=batch_size, desc="lambada", progress=progress)
    return [
        LambadaScore(
            nll=math.fsum(row.nll),
            target_tokens=len(row.nll),
            correct=all(row.is_argmax),
            truncated=cut,
        )
        for row, cut in zip(scored, truncated)
    ]


def evaluate_lambada(
    scorer: LMScorer,
    tokenizer: Any,
    examples: list[str],
    *,
    strict: bool = True,
    batch_size: int = 8,
    progress: bool = True,
) -> dict[str, float | int]:
    """LAMBADA accuracy and target perplexities over ``examples`` (the texts)."""
    if not examples:
        raise UserError("LAMBADA: no examples to evaluate")
    scores = score_lambada(
        scorer, tokenizer, examples, strict=strict, batch_size=batch_size, progress=progress
    )
    correct = sum(s.correct for s in scores)
    total_nll = math.fsum(s.nll for s in scores)
    target_tokens = sum(s.target_tokens for s in scores)
    return {
        "accuracy": correct / len(scores),
        "correct": correct,
        "count": len(scores),
        "ppl": _exp(total_nll / len(scores)),
        "token_ppl": _exp(total_nll / target_tokens),
        "target_tokens": target_tokens,
        "truncated": sum(s.truncated for s in scores),
    }


def _exp(x: float) -> float:
    return math.exp(x) if x < 709.0 else math.inf
