"""Harness requests as scoring rows, and the length-sorted, data-parallel order they run in.

Pure list manipulation (no model, no ``lm_eval`` import except for the harness's own rolling
window function, reused so windows are the harness's by construction).

A scoring row is ``(input_ids, target_ids)`` with ``IGNORE`` targets where nothing is scored
(the :func:`mlm_eval.scoring.scorer.score_rows` convention).
"""

from __future__ import annotations

from collections.abc import Sequence

from mlm_eval.scoring.scorer import IGNORE

Row = tuple[list[int], list[int]]


def loglikelihood_row(context: Sequence[int], continuation: Sequence[int], max_length: int) -> Row:
    """The row scoring ``continuation`` after ``context``, cut on the left to ``max_length`` inputs.

    The same window as the harness's ``HFLM``: ``(context + continuation)[-(max_length + 1):]``
    without its last token as input; the last ``len(continuation)`` positions are scored.
    """
    if not continuation:
        raise ValueError("empty continuation")
    if len(continuation) > max_length:
        raise ValueError(f"continuation of {len(continuation)} tokens exceeds max_length {max_length}")
    whole = (list(context) + list(continuation))[-(max_length + 1) :]
    inputs, targets = whole[:-1], whole[1:]
    n = len(continuation)
    return inputs, [IGNORE] * (len(targets) - n) + targets[-n:]


def rolling_rows(tokens: Sequence[int], prefix_token: int, max_length: int) -> list[Row]:
    """Disjoint rolling windows of a document (the harness's ``loglikelihood_rolling`` windows).

    Every token is scored exactly once, the first one after ``prefix_token``; each window has
    at most ``max_length`` inputs and scores only the tokens no earlier window scored.
    """
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    rows: list[Row] = []
    windows = get_rolling_token_windows(
        token_list=list(tokens), prefix_token=prefix_token, max_seq_len=max_length, context_len=1
    )
    for context, continuation in map(make_disjoint_window, windows):
        rows.append(loglikelihood_row(context, continuation, max_length))
    return rows


def length_order(lengths: Sequence[int]) -> list[int]:
    """Indices sorted longest first (ties by index): batches hold similar lengths, OOMs come first."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def deal(order: Sequence[int], replicas: int, replica: int) -> list[int]:
    """Replica ``replica``'s share of ``order``: every ``replicas``-th entry (balanced lengths)."""
    return list(order[replica::replicas])
