"""Rank layout: Megatron's 16-rank example and brute-force invariants (no processes)."""

from __future__ import annotations

import itertools
import json

import pytest

from pretrain.parallel.layout import compute_layout
from pretrain.parallel.layout_cli import main as layout_main
from pretrain.utils.errors import UserError


def test_sixteen_rank_example_from_reference() -> None:
    lay = compute_layout(world_size=16, tp=2, pp=4)
    assert lay.dp == 2
    assert [list(g) for g in lay.tp_groups] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert [list(g) for g in lay.dp_groups] == [
        [0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]
    ]  # fmt: skip
    assert [list(g) for g in lay.pp_groups] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert [list(g) for g in lay.model_parallel_groups] == [
        [0, 1, 4, 5, 8, 9, 12, 13],
        [2, 3, 6, 7, 10, 11, 14, 15],
    ]
    assert [list(g) for g in lay.embedding_groups] == [[0, 12], [1, 13], [2, 14], [3, 15]]
    c = lay.coords(13)
    assert (c.tp_rank, c.dp_rank, c.pp_rank) == (1, 0, 3)


TRIPLES = [
    (w, t, p)
    for w in (1, 2, 4, 6, 8, 12, 16, 24, 32, 64)
    for t in (1, 2, 3, 4, 8)
    for p in (1, 2, 3, 4, 8)
    if w % (t * p) == 0
]


@pytest.mark.parametrize(("world", "tp", "pp"), TRIPLES)
def test_layout_invariants(world: int, tp: int, pp: int) -> None:
    lay = compute_layout(world_size=world, tp=tp, pp=pp)
    dp = world // (tp * pp)
    for kind, size in (("tp", tp), ("dp", dp), ("pp", pp), ("model_parallel", tp * pp)):
        groups = getattr(lay, f"{kind}_groups")
        flat = sorted(itertools.chain.from_iterable(groups))
        assert flat == list(range(world)), f"{kind}: every rank in exactly one group"
        assert all(len(g) == size for g in groups)
    for r in range(world):
        c = lay.coords(r)
        assert lay.rank_of(tp_rank=c.tp_rank, dp_rank=c.dp_rank, pp_rank=c.pp_rank) == r
        tp_g, dp_g, pp_g = (lay.group_containing(k, r) for k in ("tp", "dp", "pp"))
        # Orthogonality: two different kinds of group share only the rank itself.
        assert set(tp_g) & set(dp_g) == {r} and set(tp_g) & set(pp_g) == {r} and set(dp_g) & set(pp_g) == {r}
        assert all(lay.coords(x).pp_rank == c.pp_rank and lay.coords(x).dp_rank == c.dp_rank for x in tp_g)
        assert [lay.coords(x).pp_rank for x in pp_g] == list(range(pp))
        mp = lay.group_containing("model_parallel", r)
        assert set(mp) == {x for x in range(world) if lay.coords(x).dp_rank == c.dp_rank}
        emb = lay.group_containing("embedding", r)
        if c.pp_rank in (0, pp - 1):
            assert emb == tuple(sorted({pp_g[0], pp_g[-1]}))


@pytest.mark.parametrize(
    ("world", "tp", "pp", "vp"), [(6, 4, 1, 1), (8, 3, 1, 1), (0, 1, 1, 1), (8, -2, 1, 1), (8, 2, 1, 2)]
)
def test_bad_sizes_raise_user_error(world: int, tp: int, pp: int, vp: int) -> None:
    with pytest.raises(UserError):
        compute_layout(world_size=world, tp=tp, pp=pp, vp=vp)


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert layout_main(["--world-size", "16", "--tp", "2", "--pp", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"tp", "pp", "dp", "model_parallel", "embedding"}
    assert out["pp"][0] == [0, 4, 8, 12]
    assert out["embedding"][3] == [3, 15]


def test_cli_table_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert layout_main(["--world-size", "8", "--tp", "2", "--pp", "2"]) == 0
    assert "tp groups" in capsys.readouterr().out
    for bad in (["--world-size", "6", "--tp", "4"], ["--world-size", "8", "--tp", "0"]):
        with pytest.raises(SystemExit) as exc:
            layout_main(bad)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ")
