"""Window planning for the paper's overlapping WikiText evaluation (appendix E.1).

A token stream of ``T`` tokens has targets at positions ``1 .. T-1`` (position 0 has no context).
Windows hold at most ``seq_length`` input tokens and start every ``overlap`` tokens. The first
window scores all its targets; every later window scores only the targets the previous windows
did not reach, which is its last ``overlap`` targets (the last window: whatever remains). So each
target is scored exactly once, with context reaching back to its window's start, and no window
is planned that would score nothing (upstream Megatron-LM plans ``ceil((T-1-o)/o)+1`` windows,
most of them empty at the end of the stream).

A window is a triple ``(start, end, score_from)`` of token positions: its inputs are
``tokens[start : end-1]``, its targets ``tokens[start+1 : end]``, and it scores the targets at
positions ``score_from .. end-1``.
"""

from __future__ import annotations

from typing import NamedTuple


class Window(NamedTuple):
    """One evaluation window over token positions (see the module docstring)."""

    start: int
    end: int
    score_from: int


def plan_windows(num_tokens: int, seq_length: int, overlap: int) -> list[Window]:
    """Plan the overlapping windows over ``num_tokens`` tokens.

    ``overlap`` is the stride between window starts (the paper's 32); ``overlap == seq_length``
    gives disjoint windows. It must not exceed ``seq_length``, or targets would be skipped.
    """
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    if not 1 <= overlap <= seq_length:
        raise ValueError(f"overlap must be in 1..seq_length ({seq_length}), got {overlap}")
    if num_tokens < 2:
        return []
    windows = [Window(0, min(seq_length + 1, num_tokens), 1)]
    while windows[-1].end < num_tokens:
        start = windows[-1].start + overlap
        windows.append(Window(start, min(start + seq_length + 1, num_tokens), windows[-1].end))
    return windows


def count_windows(num_tokens: int, seq_length: int, overlap: int) -> int:
    """Closed form of ``len(plan_windows(...))``: 1 + ceil((T - 1 - seq_length) / overlap)."""
    if num_tokens < 2:
        return 0
    rest = max(num_tokens - 1 - seq_length, 0)
    return 1 + -(-rest // overlap)
