"""Megatron's rank layout as a pure function (no processes).

Ranks are laid out with tensor parallel fastest, then data parallel, then pipeline parallel::

    rank = tp_rank + t * dp_rank + t * d * pp_rank

so the ``t`` ranks of a TP group are neighbours (one node, fast links) and each pipeline group
strides over all of the machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.utils.errors import UserError

Groups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True, kw_only=True)
class RankCoord:
    """A rank's coordinates in the (tp, dp, pp) grid."""

    rank: int
    tp_rank: int
    dp_rank: int
    pp_rank: int


@dataclass(frozen=True, kw_only=True)
class RankLayout:
    """Every process group of a (world, t, p, V) run, as tuples of global ranks."""

    world_size: int
    tp: int
    pp: int
    dp: int
    vp: int
    tp_groups: Groups
    dp_groups: Groups
    pp_groups: Groups
    model_parallel_groups: Groups
    embedding_groups: Groups

    def coords(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return RankCoord(
            rank=rank,
            tp_rank=rank % self.tp,
            dp_rank=(rank // self.tp) % self.dp,
            pp_rank=rank // (self.tp * self.dp),
        )

    def rank_of(self, *, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * dp_rank + self.tp * self.dp * pp_rank

    def group_containing(self, kind: str, rank: int) -> tuple[int, ...]:
        """The group of ``kind`` (``tp``, ``dp``, ``pp``, ``model_parallel``, ``embedding``) holding ``rank``."""
        groups: Groups = getattr(self, f"{kind}_groups")
        for group in groups:
            if rank in group:
                return group
        return ()

    def as_dict(self) -> dict[str, list[list[int]]]:
        return {
            "tp": [list(g) for g in self.tp_groups],
            "pp": [list(g) for g in self.pp_groups],
            "dp": [list(g) for g in self.dp_groups],
            "model_parallel": [list(g) for g in self.model_parallel_groups],
            "embedding": [list(g) for g in self.embedding_groups],
        }


def check_sizes(world_size: int, tp: int, pp: int, vp: int = 1) -> int:
    """Validate the sizes and return the data-parallel size ``d = world / (t * p)``."""
    for name, value in (("--world-size", world_size), ("--tp", tp), ("--pp", pp), ("--vp", vp)):
        if not isinstance(value, int) or value <= 0:
            raise UserError(f"{name} must be a positive integer, got {value}")
    if world_size % (tp * pp):
        raise UserError(f"--world-size {world_size} is not divisible by --tp {tp} x --pp {pp} = {tp * pp}")
    if vp > 1 and pp < 2:
        raise UserError(f"--vp {vp} needs --pp >= 2")
    return world_size // (tp * pp)


def compute_layout(*, world_size: int, tp: int, pp: int, vp: int = 1) -> RankLayout:
    """Compute all groups for ``world_size`` ranks split ``tp`` x ``pp`` (x data parallel)."""
    dp = check_sizes(world_size, tp, pp, vp)

    def rank(t: int, d: int, p: int) -> int:
        return t + tp * d + tp * dp * p

    tp_groups = tuple(tuple(rank(t, d, p) for t in range(tp)) for p in range(pp) for d in range(dp))
    dp_groups = tuple(tuple(rank(t, d, p) for d in range(dp)) for p in range(pp) for t in range(tp))
    pp_groups = tuple(tuple(rank(t, d, p) for p in range(pp)) for d in range(dp) for t in range(tp))
    mp_groups = tuple(tuple(sorted(rank(t, d, p) for p in range(pp) for t in range(tp))) for d in range(dp))
    # The first and last stage of each pipeline share the word embeddings (tied output layer).
    emb_groups = tuple(tuple(sorted({g[0], g[-1]})) for g in pp_groups)
    return RankLayout(
        world_size=world_size,
        tp=tp,
        pp=pp,
        dp=dp,
        vp=vp,
        tp_groups=tp_groups,
        dp_groups=dp_groups,
        pp_groups=pp_groups,
        model_parallel_groups=mp_groups,
        embedding_groups=emb_groups,
    )
