"""Window planning: every target scored exactly once, right context, no empty windows."""

from __future__ import annotations

import math

import pytest

from mlm_eval.tasks.windows import Window, count_windows, plan_windows


def expected_context_start(target: int, seq_length: int, overlap: int) -> int:
    """Independent statement of the paper's rule: window k >= 1 scores targets w+(k-1)o+1 .. w+ko."""
    if target <= seq_length:
        return 0
    return overlap * math.ceil((target - seq_length) / overlap)


def test_hand_example() -> None:
    # T=10, w=4, o=2: window 0 scores 1..4, then 5..6 (start 2), 7..8 (start 4), 9 (start 6).
    assert plan_windows(10, 4, 2) == [Window(0, 5, 1), Window(2, 7, 5), Window(4, 9, 7), Window(6, 10, 9)]


def test_edge_lengths() -> None:
    w, o = 8, 3
    assert plan_windows(0, w, o) == [] and plan_windows(1, w, o) == []
    assert plan_windows(2, w, o) == [Window(0, 2, 1)]
    assert plan_windows(5, w, o) == [Window(0, 5, 1)]  # T < w: one short window
    assert plan_windows(w, w, o) == [Window(0, w, 1)]  # T = w
    assert plan_windows(w + 1, w, o) == [Window(0, w + 1, 1)]  # T = w + 1: w inputs, w targets
    assert plan_windows(w + 2, w, o) == [Window(0, w + 1, 1), Window(o, w + 2, w + 1)]


def test_disjoint_when_overlap_equals_seq_length() -> None:
    # o = w: window k has inputs k*w .. k*w+w-1 and scores all of its targets.
    assert plan_windows(10, 3, 3) == [Window(0, 4, 1), Window(3, 7, 4), Window(6, 10, 7)]


@pytest.mark.parametrize("seq_length", [1, 2, 3, 5, 8, 13])
def test_properties_over_many_lengths(seq_length: int) -> None:
    for overlap in range(1, seq_length + 1):
        for num_tokens in range(0, 4 * seq_length + 7):
            check_plan(num_tokens, seq_length, overlap)


def check_plan(num_tokens: int, seq_length: int, overlap: int) -> None:
    windows = plan_windows(num_tokens, seq_length, overlap)
    assert len(windows) == count_windows(num_tokens, seq_length, overlap)
    scored: list[int] = []
    for k, (start, end, score_from) in enumerate(windows):
        assert start == k * overlap  # windows start every `overlap` tokens
        assert 1 <= end - start - 1 <= seq_length  # 1..w inputs
        assert start < score_from < end
        targets = range(score_from, end)
        assert len(targets) > 0  # no empty window
        if k == 0:
            assert score_from == start + 1  # the first window scores all its targets
        elif k < len(windows) - 1:
            assert len(targets) == overlap  # later windows: exactly their last `overlap`
            assert end == start + seq_length + 1
        else:
            assert len(targets) <= overlap
        for t in targets:
            assert expected_context_start(t, seq_length, overlap) == start
        scored.extend(targets)
    assert scored == list(range(1, num_tokens))  # each target exactly once, in order


def test_long_stream_window_count_matches_closed_form() -> None:
    # The paper's setting on a WikiText-sized stream; upstream would plan ceil((T-1-o)/o)+1 windows.
    num_tokens, w, o = 270329, 1024, 32
    windows = plan_windows(num_tokens, w, o)
    assert len(windows) == 1 + math.ceil((num_tokens - 1 - w) / o) == 8417
    assert windows[-1].end == num_tokens
    assert math.ceil((num_tokens - 1 - o) / o) + 1 - len(windows) == 31  # upstream's empty windows


@pytest.mark.parametrize(("w", "o"), [(0, 1), (4, 0), (4, 5), (-1, -1)])
def test_invalid_arguments(w: int, o: int) -> None:
    with pytest.raises(ValueError):
        plan_windows(10, w, o)
