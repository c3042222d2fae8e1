"""Megatron's rank layout as a pure function (no processes).

Ranks are laid out with tensor parallel fastest, then data parallel, then pipeline parallel::

    rank = tp_rank + t * dp_rank + t * d * pp_rank

so the ``t`` ranks of a TP group are neighbours (one node, fast links) and each pipeline group
strides over all of the machine.

Mixture-of-experts layers see the same ranks through a second grid, megatron-core's expert rank
generator (order tp-ep-dp-pp): within a pipeline stage the ``t * d`` ranks are regrouped as expert
tensor parallel (ETP, fastest) x expert parallel (EP) x expert data parallel (EDP = t d / (ETP EP))::

    rank = etp_rank + ETP * ep_rank + ETP * EP * edp_rank + t * d * pp_rank

so EP is carved out of data parallelism (with ETP = t an EP group holds one TP rank of each of EP
data-parallel replicas). Expert weights are reduced (and ZeRO-1 sharded) over the EDP groups.
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
    ep: int = 1
    etp: int = 1
    edp: int = 1
    ep_groups: Groups = ()
    etp_groups: Groups = ()
    edp_groups: Groups = ()
    expert_model_parallel_groups: Groups = ()  # megatron-core's tp-ep-pp of the expert grid

    def coords(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return RankCoord(
            rank=rank,
            tp_rank=rank % self.tp,
            dp_rank=(rank // self.tp) % self.dp,
            pp_rank=rank // (self.tp * self.dp),
        )

    def expert_coords(self, rank: int) -> tuple[int, int, int]:
        """``(etp_rank, ep_rank, edp_rank)`` of ``rank`` in the expert grid."""
        local = rank % (self.tp * self.dp)
        return local % self.etp, (local // self.etp) % self.ep, local // (self.etp * self.ep)

    def rank_of(self, *, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * dp_rank + self.tp * self.dp * pp_rank

    def group_containing(self, kind: str, rank: int) -> tuple[int, ...]:
        """The group of ``kind`` (``tp``, ``dp``, ``pp``, ``model_parallel``, ``embedding``, ``ep``,
        ``etp``, ``edp``, ``expert_model_parallel``) holding ``rank``."""
        groups: Groups = getattr(self, f"{kind}_groups")
        for group in groups:
            if rank in group:
                return group
        return ()

    @property
    def has_expert_groups(self) -> bool:
        """Whether the expert grid differs from the dense one (EP > 1 or ETP != TP)."""
        return self.ep > 1 or self.etp != self.tp

    def as_dict(self) -> dict[str, list[list[int]]]:
        """Every kind of group; the expert kinds only where :attr:`has_expert_groups`."""
        dense = {
            "tp": [list(g) for g in self.tp_groups],
            "pp": [list(g) for g in self.pp_groups],
            "dp": [list(g) for g in self.dp_groups],
            "model_parallel": [list(g) for g in self.model_parallel_groups],
            "embedding": [list(g) for g in self.embedding_groups],
        }
        if not self.has_expert_groups:
            return dense
        return {
            **dense,
            "ep": [list(g) for g in self.ep_groups],
            "etp": [list(g) for g in self.etp_groups],
            "edp": [list(g) for g in self.edp_groups],
            "expert_model_parallel": [list(g) for g in self.expert_model_parallel_groups],
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


def check_expert_sizes(world_size: int, tp: int, pp: int, ep: int, etp: int) -> int:
    """Validate the expert grid and return the expert data-parallel size ``t d / (ETP EP)``."""
    for name, value in (("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp)):
        if not isinstance(value, int) or value <= 0:
            raise UserError(f"{name} must be a positive integer, got {value}")
    if (world_size // pp) % (etp * ep):
        raise UserError(
            f"--world-size {world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
            f"--expert-model-parallel-size {ep} x --pp {pp} = {etp * ep * pp}"
        )
    return world_size // (etp * ep * pp)


def _expert_groups(tp: int, dp: int, pp: int, ep: int, etp: int) -> dict[str, Groups]:
    edp = tp * dp // (etp * ep)

    def rank(t: int, e: int, d: int, p: int) -> int:
        return t + etp * e + etp * ep * d + tp * dp * p

    E, T, D, P = range(ep), range(etp), range(edp), range(pp)
    return {
        "ep_groups": tuple(tuple(rank(t, e, d, p) for e in E) for p in P for d in D for t in T),
        "etp_groups": tuple(tuple(rank(t, e, d, p) for t in T) for p in P for d in D for e in E),
        "edp_groups": tuple(tuple(rank(t, e, d, p) for d in D) for p in P for e in E for t in T),
        "expert_model_parallel_groups": tuple(
            tuple(rank(t, e, d, p) for p in P for e in E for t in T) for d in D
        ),
    }


def compute_layout(
    *, world_size: int, tp: int, pp: int, vp: int = 1, ep: int = 1, etp: int | None = None
) -> RankLayout:
    """Compute all groups for ``world_size`` ranks split ``tp`` x ``pp`` (x data parallel), and
    the expert groups of ``ep`` x ``etp`` (``None``: ``tp``) x expert data parallel."""
    dp = check_sizes(world_size, tp, pp, vp)
    etp = tp if etp is None else etp
    edp = check_expert_sizes(world_size, tp, pp, ep, etp)

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
        ep=ep,
        etp=etp,
        edp=edp,
        **_expert_groups(tp, dp, pp, ep, etp),
    )
