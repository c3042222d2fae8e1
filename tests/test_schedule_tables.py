"""Pure schedule-table tests (no processes) and a dataflow simulation of all ranks."""

from __future__ import annotations

from collections import defaultdict, deque

import pytest

from pretrain.pipeline.partition import local_to_global, stage_layer_numbers
from pretrain.pipeline.schedule_table import Action, build_table, interleaved, one_f_one_b, virtual_order
from pretrain.utils.errors import UserError


def test_1f1b_p4_m8_tables() -> None:
    for r, warm in enumerate([3, 2, 1, 0]):
        t = one_f_one_b(p=4, r=r, m=8)
        assert t[:warm] == [Action("F", i) for i in range(warm)]
        assert t[warm] == Action("F", warm) and t[warm + 1] == Action("B", 0)
        assert t[len(t) - warm :] == [Action("B", i) for i in range(8 - warm, 8)]
        assert len(t) == 16
    assert one_f_one_b(p=4, r=3, m=8) == [a for i in range(8) for a in (Action("F", i), Action("B", i))]


def _inflight_max(table: list[Action]) -> int:
    live, peak = set(), 0
    for a in table:
        key = (a.microbatch, a.chunk)
        if a.kind == "F":
            live.add(key)
            peak = max(peak, len(live))
        else:
            live.remove(key)
    return peak


@pytest.mark.parametrize(("p", "m"), [(4, 8), (2, 3), (4, 2), (8, 16), (3, 7)])
def test_1f1b_properties(p: int, m: int) -> None:
    for r in range(p):
        t = one_f_one_b(p=p, r=r, m=m)
        _check_each_once_and_order(t, m, 1)
        assert _inflight_max(t) <= p - r
        assert _inflight_max(t) == min(p - r, m)


def test_interleaved_p4_v2_m8_warmups() -> None:
    for r, warm in enumerate([10, 8, 6, 4]):
        t = interleaved(p=4, r=r, m=8, vp=2)
        first_b = next(i for i, a in enumerate(t) if a.kind == "B")
        assert first_b == warm + 1  # warmup forwards, then the first steady forward, then B
        _check_each_once_and_order(t, 8, 2)


def test_reference_table_p2_v2_m5_g3() -> None:
    order = virtual_order(5, 2, 3)
    assert [mb for mb, _ in order] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in order] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    t = interleaved(p=2, r=0, m=5, vp=2, group=3)
    backward_chunks = [a.chunk for a in t if a.kind == "B"]
    assert backward_chunks == [1 - c for c in [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]]


def _check_each_once_and_order(table: list[Action], m: int, vp: int) -> None:
    fwd = [(a.microbatch, a.chunk) for a in table if a.kind == "F"]
    bwd = [(a.microbatch, a.chunk) for a in table if a.kind == "B"]
    everything = sorted((i, c) for i in range(m) for c in range(vp))
    assert sorted(fwd) == everything and sorted(bwd) == everything
    pos = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(table)}
    for i, a in enumerate(table):
        if a.kind == "B":
            assert pos[("F", a.microbatch, a.chunk)] < i, f"backward before forward: {a}"


def _simulate(p: int, m: int, vp: int, group: int | None = None) -> None:
    """Run all ranks' tables as a dataflow with FIFO channels; fail on deadlock or misordering."""
    tables = {r: deque(build_table(p=p, r=r, m=m, vp=vp, group=group)) for r in range(p)}
    channels: dict[tuple[int, int, str], deque] = defaultdict(deque)
    last_v = p * vp - 1
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            if not tables[r]:
                continue
            a = tables[r][0]
            v = a.chunk * p + r  # virtual stage
            if a.kind == "F" and v > 0:
                ch = channels[((r - 1) % p, r, "act")]
                if not ch:
                    continue
                assert ch.popleft() == (a.microbatch, v - 1), "activation stream out of order"
            if a.kind == "B" and v < last_v:
                ch = channels[((r + 1) % p, r, "grad")]
                if not ch:
                    continue
                assert ch.popleft() == (a.microbatch, v + 1), "gradient stream out of order"
            tables[r].popleft()
            progressed = True
            if a.kind == "F" and v < last_v:
                channels[(r, (r + 1) % p, "act")].append((a.microbatch, v))
            if a.kind == "B" and v > 0:
                channels[(r, (r - 1) % p, "grad")].append((a.microbatch, v))
    assert all(not t for t in tables.values()), f"deadlock: {[list(t)[:3] for t in tables.values()]}"


@pytest.mark.parametrize(
    ("p", "m", "vp", "g"),
    [(2, 4, 1, None), (4, 8, 1, None), (4, 3, 1, None), (2, 4, 2, None), (4, 8, 2, None),
     (2, 5, 2, 3), (4, 4, 3, None), (4, 9, 2, None), (3, 6, 2, None)],
)  # fmt: skip
def test_all_ranks_complete_without_deadlock(p: int, m: int, vp: int, g: int | None) -> None:
    _simulate(p, m, vp, g)


def test_partition_virtual_and_uneven() -> None:
    layers = stage_layer_numbers(8, pp=2, vp=2)
    assert layers == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert local_to_global(1, stage=1, chunk=1, layers=layers) == 7
    assert stage_layer_numbers(6, pp=3) == [[[0, 1]], [[2, 3]], [[4, 5]]]
    assert stage_layer_numbers(8, pp=3, first=2, last=2) == [[[0, 1]], [[2, 3, 4, 5]], [[6, 7]]]
    assert stage_layer_numbers(7, pp=3, first=1) == [[[0]], [[1, 2, 3]], [[4, 5, 6]]]
    for bad in (dict(num_layers=7, pp=2), dict(num_layers=8, pp=2, vp=3), dict(num_layers=8, pp=3, first=3)):
        with pytest.raises(UserError):
            stage_layer_numbers(**bad)  # type: ignore[arg-type]


def test_fthenb_table_and_simulation() -> None:
    t = build_table(p=4, r=1, m=8, kind="fthenb")
    assert t == [Action("F", i) for i in range(8)] + [Action("B", i) for i in range(8)]
    assert _inflight_max(t) == 8
    with pytest.raises(UserError):
        build_table(p=2, r=0, m=2, kind="gpipe-ish")
