"""``ParallelState``: this rank's coordinates and process groups, passed explicitly to layers.

There are no module-level process groups: every collective in the engine takes its group from
a ``ParallelState`` (``None`` for a group of size one, where collectives are skipped).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.layout import RankLayout, compute_layout
from pretrain.parallel.rng import RNGStatesTracker, model_parallel_seed

ProcessGroup = dist.ProcessGroup


@dataclass(kw_only=True)
class ParallelState:
    """Groups and coordinates of one rank. Build with :meth:`single` or :meth:`from_distributed`."""

    layout: RankLayout
    rank: int
    tp_group: ProcessGroup | None = None
    pp_group: ProcessGroup | None = None
    dp_group: ProcessGroup | None = None
    mp_group: ProcessGroup | None = None
    embedding_group: ProcessGroup | None = None
    ep_group: ProcessGroup | None = None  # expert parallel: ranks holding different experts
    etp_group: ProcessGroup | None = None  # expert tensor parallel (the TP group, or none with ETP 1)
    edp_group: ProcessGroup | None = None  # expert data parallel: replicas of the same expert shards
    expert_mp_group: ProcessGroup | None = None  # ETP x EP x PP: disjoint expert shards (grad norm)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rng: RNGStatesTracker = field(default_factory=RNGStatesTracker)

    # --- coordinates -------------------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank).tp_rank

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank).dp_rank

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank).pp_rank

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def vp_size(self) -> int:
        return self.layout.vp

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def etp_size(self) -> int:
        return self.layout.etp

    @property
    def edp_size(self) -> int:
        return self.layout.edp

    @property
    def ep_rank(self) -> int:
        return self.layout.expert_coords(self.rank)[1]

    @property
    def etp_rank(self) -> int:
        return self.layout.expert_coords(self.rank)[0]

    @property
    def edp_rank(self) -> int:
        return self.layout.expert_coords(self.rank)[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def pp_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's pipeline, stage 0 first (used to address p2p peers)."""
        return self.layout.group_containing("pp", self.rank)

    @property
    def dp_ranks(self) -> tuple[int, ...]:
        return self.layout.group_containing("dp", self.rank)

    @property
    def embedding_ranks(self) -> tuple[int, ...]:
        return self.layout.group_containing("embedding", self.rank)

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def single(cls, *, device: str | torch.device = "cpu", seed: int | None = None) -> ParallelState:
        """A one-process state (all sizes 1, no groups)."""
        state = cls(
            layout=compute_layout(world_size=1, tp=1, pp=1),
            rank=0,
            device=torch.device(device),
            rng=RNGStatesTracker("cuda" if torch.device(device).type == "cuda" else "cpu"),
        )
        if seed is not None:
            state.seed(seed)
        return state

    @classmethod
    def from_distributed(
        cls, config: ParallelConfig, *, device: str | torch.device = "cpu", seed: int | None = None
    ) -> ParallelState:
        """Create every group with ``torch.distributed.new_group`` (collective on all ranks).

        ``new_group`` must be called by every rank for every group in the same order, so all
        groups of the layout are created here, and each rank keeps the ones it belongs to.
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised (launch with torchrun)")
        world, rank = dist.get_world_size(), dist.get_rank()
        layout = compute_layout(
            world_size=world, tp=config.tp, pp=config.pp, vp=config.vp, ep=config.ep, etp=config.etp
        )
        mine: dict[str, ProcessGroup | None] = {}
        made: dict[tuple[int, ...], ProcessGroup] = {}
        for kind in ("tp", "pp", "dp", "model_parallel", "embedding"):
            for ranks in getattr(layout, f"{kind}_groups"):
                group = made[ranks] = dist.new_group(list(ranks))
                if rank in ranks:
                    mine[kind] = group if len(ranks) > 1 else None
        for kind in ("ep", "etp", "edp", "expert_model_parallel"):  # reuse equal dense groups
            for ranks in getattr(layout, f"{kind}_groups"):
                if len(ranks) > 1 and ranks not in made:
                    made[ranks] = dist.new_group(list(ranks))
                if rank in ranks:
                    mine[kind] = made[ranks] if len(ranks) > 1 else None
        dev = torch.device(device)
        state = cls(
            layout=layout,
            rank=rank,
            tp_group=mine.get("tp"),
            pp_group=mine.get("pp"),
            dp_group=mine.get("dp"),
            mp_group=mine.get("model_parallel"),
            embedding_group=mine.get("embedding"),
            ep_group=mine.get("ep"),
            etp_group=mine.get("etp"),
            edp_group=mine.get("edp"),
            expert_mp_group=mine.get("expert_model_parallel"),
            device=dev,
            rng=RNGStatesTracker("cuda" if dev.type == "cuda" else "cpu"),
        )
        if seed is not None:
            state.seed(seed)
        return state

    def seed(self, seed: int) -> None:
        """Seed dropout generators: same on TP ranks outside TP regions, per-rank inside."""
        model_parallel_seed(self.rng, seed, tp_rank=self.tp_rank, pp_rank=self.pp_rank)
