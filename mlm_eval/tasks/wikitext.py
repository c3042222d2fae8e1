"""WikiText-103 perplexity: the paper's overlapping-window method and lm-evaluation-harness's.

``paper`` (appendix E.1, Megatron-LM ``tasks/zeroshot_gpt``): T_o is counted on the raw text,
the whole detokenized file is one token stream, scored in overlapping windows
(:mod:`mlm_eval.tasks.windows`); adjusted ppl = exp(NLL / (T_o - 1)), token ppl = exp(NLL / (T - 1)).
Upstream clamps both exponents at 20; those variants are reported separately, labelled.

``lm-eval`` (lm-evaluation-harness task ``wikitext``): per document, disjoint rolling windows
with one carried token, word/byte perplexity over the raw pages (see
:func:`evaluate_wikitext_lm_eval`).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from mlm_eval.scoring.scorer import IGNORE, LMScorer, as_text_encoder, document_prefix, score_rows
from mlm_eval.tasks.detokenize import count_original_tokens, wikitext_detokenize
from mlm_eval.tasks.windows import Window, plan_windows
from pretrain.utils.errors import UserError

UPSTREAM_EXPONENT_CLAMP = 20.0  # Megatron-LM: math.exp(min(20, loss))


def read_wikitext(path: str | os.PathLike[str]) -> str:
    """Read a raw WikiText file exactly (bytes decoded as UTF-8, newlines untouched)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise UserError(f"{path}: cannot read WikiText data ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not valid UTF-8 ({exc.reason})") from None
    if not text.strip():
        raise UserError(f"{path}: WikiText data is empty")
    return text


def _check_seq_length(scorer: LMScorer, seq_length: int) -> None:
    if not 1 <= seq_length <= scorer.max_length:
        raise UserError(f"--seq-length {seq_length} must be in 1..{scorer.max_length} (the model's maximum)")


def evaluate_wikitext_paper(
    scorer: LMScorer,
    tokenizer: Any,
    raw_text: str,
    *,
    seq_length: int = 1024,
    overlap: int = 32,
    batch_size: int = 8,
    progress: bool = True,
    limit: int | None = None,
) -> dict[str, float | int]:
    """The paper's WikiText-103 evaluation of ``raw_text`` (the raw ``wiki.test.tokens``).

    ``limit``: score only the first ``limit`` windows (a quick look); the losses are then per
    scored target, and the adjusted loss scales the token loss by (T - 1) / (T_o - 1), which is
    the full evaluation's formula when every target is scored.
    """
    _check_seq_length(scorer, seq_length)
    if not 1 <= overlap <= seq_length:
        raise UserError(f"--overlap {overlap} must be in 1..--seq-length ({seq_length})")
    num_original = count_original_tokens(raw_text)
    encoder = as_text_encoder(tokenizer)
    # A BOS-adding tokenizer (Llama) starts the stream with BOS, so every original token is a target.
    bos = document_prefix(encoder)
    tokens = bos + encoder.encode(wikitext_detokenize(raw_text))
    predicted_original = num_original - 1 + len(bos)  # original tokens that are targets
    if len(tokens) < 2 or num_original < 2:
        raise UserError(f"WikiText text too short: {len(tokens)} tokens, {num_original} original tokens")
    windows = plan_windows(len(tokens), seq_length, overlap)
    planned = len(windows)
    if limit is not None:
        windows = windows[:limit]
    rows = [_window_row(tokens, w) for w in windows]
    scored = score_rows(scorer, rows, batch_size=batch_size, desc="wikitext103", progress=progress)
    total_nll = math.fsum(x for row in scored for x in row.nll)
    scored_targets = sum(len(row.nll) for row in scored)
    expected = (windows[-1].end - 1) if limit is not None else len(tokens) - 1
    if scored_targets != expected:  # the planner's guarantee; cheap to keep honest
        raise AssertionError(f"scored {scored_targets} targets, expected {expected}")
    if scored_targets == len(tokens) - 1:
        token_loss = total_nll / (len(tokens) - 1)
        adjusted_loss = total_nll / predicted_original
    else:
        token_loss = total_nll / scored_targets
        adjusted_loss = token_loss * (len(tokens) - 1) / predicted_original
    return {
        **_perplexities(adjusted_loss, token_loss),
        "total_nll": total_nll,
        "num_tokens": len(tokens),
        "num_original_tokens": num_original,
        "scored_targets": scored_targets,
        "windows": len(windows),
        "planned_windows": planned,
        "seq_length": seq_length,
        "overlap": overlap,
    }


def _window_row(tokens: list[int], w: Window) -> tuple[list[int], list[int]]:
    """(inputs, targets) of one window: targets before ``w.score_from`` are :data:`IGNORE`."""
    targets = [
        t if w.start + 1 + j >= w.score_from else IGNORE for j, t in enumerate(tokens[w.start + 1 : w.end])
    ]
    return tokens[w.start : w.end - 1], targets


def _perplexities(adjusted_loss: float, token_loss: float) -> dict[str, float]:
    """Adjusted and token perplexity, and both as upstream reports them (exponent clamped at 20)."""
    return {
        "adjusted_ppl": _exp(adjusted_loss),
        "token_ppl": _exp(token_loss),
        "adjusted_ppl_upstream_clamped": math.exp(min(UPSTREAM_EXPONENT_CLAMP, adjusted_loss)),
        "token_ppl_upstream_clamped": math.exp(min(UPSTREAM_EXPONENT_CLAMP, token_loss)),
    }


def _exp(x: float) -> float:
    """exp that reports inf instead of raising for a hopeless model."""
    return math.exp(x) if x < 709.0 else math.inf


def split_wikitext_documents(raw_text: str) -> list[str]:
    """Split a WikiText file into articles the way lm-evaluation-harness's dataset does.

    The rule of ``EleutherAI/wikitext_document_level`` (the harness's ``wikitext`` task data): a
    line starts a new article when, after turning ``= = =`` into ``===`` and ``= =`` into ``==``
    and stripping, it starts with ``"= "`` and ends with ``" ="`` -- a top-level `` = Title = ``
    heading (section headings `` = = Sub = = `` become ``== Sub ==`` and do not match). Pages are
    the lines joined with ``\\n`` (each page keeps its heading line); a whitespace-only page before
    a heading is dropped, and the final page is always kept.
    """
    pages: list[str] = []
    lines: list[str] = []
    for line in raw_text.split("\n"):
        heading = line.replace("= = =", "===").replace("= =", "==").strip()
        if heading.startswith("= ") and heading.endswith(" ="):
            page = "\n".join(lines)
            if page.strip():
                pages.append(page)
            lines = []
        lines.append(line)
    pages.append("\n".join(lines))
    return pages


def lm_eval_rolling_windows(
    tokens: list[int], prefix_token: int, max_length: int
) -> list[tuple[list[int], list[int]]]:
    """lm-evaluation-harness's disjoint rolling windows (``context_len=1``) as scorer rows.

    The first window is ``[prefix] + tokens[:n-1]`` predicting ``tokens[:n]`` (n = min(L, T)); each
    later window predicts the next ``L`` tokens from the token before them (one carried token),
    except the last, shorter one, which the harness fills up to ``L`` inputs with earlier tokens as
    context. Returns ``(input_ids, target_ids)`` with ``IGNORE`` on context positions.
    """
    rows: list[tuple[list[int], list[int]]] = []
    if not tokens:
        return rows
    first = min(max_length, len(tokens))
    rows.append(([prefix_token, *tokens[: first - 1]], tokens[:first]))
    predicted = first
    while predicted < len(tokens):
        count = min(len(tokens) - predicted, max_length)
        end = predicted + count
        inputs = tokens[max(end - max_length - 1, 0) : end - 1]
        rows.append((inputs, [IGNORE] * (len(inputs) - count) + tokens[predicted:end]))
        predicted = end
    return rows


def evaluate_wikitext_lm_eval(
    scorer: LMScorer,
    tokenizer: Any,
    raw_text: str | list[str],
    *,
    seq_length: int = 1024,
    batch_size: int = 8,
    progress: bool = True,
    limit: int | None = None,
) -> dict[str, float | int]:
    """lm-evaluation-harness's ``wikitext`` metrics on ``raw_text`` (``limit``: first N documents).

    ``raw_text`` is a raw file (split into articles by :func:`split_wikitext_documents`) or the
    list of pages of document-level data, scored as given. Per article: the page is detokenized with the harness's
    detokenizer (rule for rule the paper's, :func:`wikitext_detokenize`), tokenized without special
    tokens, and scored with :func:`lm_eval_rolling_windows` (prefix = BOS, else EOS, as ``HFLM``).
    Words (``len(re.split(r"\\s+", page))``) and UTF-8 bytes are counted on the raw page.
    word_perplexity = exp(-sum LL / sum words), byte_perplexity = exp(-sum LL / sum bytes),
    bits_per_byte = -sum LL / sum bytes / ln 2.
    """
    _check_seq_length(scorer, seq_length)
    encoder = as_text_encoder(tokenizer)
    prefix = encoder.prefix_token_id
    if prefix is None:
        raise UserError("the tokenizer has neither a BOS nor an EOS token, which --method lm-eval needs")
    pages = (split_wikitext_documents(raw_text) if isinstance(raw_text, str) else list(raw_text))[:limit]
    rows: list[tuple[list[int], list[int]]] = []
    words = bytes_ = num_tokens = 0
    for page in pages:
        words += len(re.split(r"\s+", page))
        bytes_ += len(page.encode("utf-8"))
        tokens = encoder.encode(wikitext_detokenize(page))
        num_tokens += len(tokens)
        rows.extend(lm_eval_rolling_windows(tokens, prefix, seq_length))
    scored = score_rows(scorer, rows, batch_size=batch_size, desc="wikitext103 (lm-eval)", progress=progress)
    loglikelihood = -math.fsum(x for row in scored for x in row.nll)
    return {
        "word_perplexity": _exp(-loglikelihood / words),
        "byte_perplexity": _exp(-loglikelihood / bytes_),
        "bits_per_byte": -loglikelihood / bytes_ / math.log(2),
        "loglikelihood": loglikelihood,
        "documents": len(pages),
        "words": words,
        "bytes": bytes_,
        "num_tokens": num_tokens,
        "windows": len(rows),
        "seq_length": seq_length,
    }
