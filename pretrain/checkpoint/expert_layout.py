"""Expert parallelism in checkpoint files: which rank file holds which routed expert.

With ``E`` experts per MoE layer and expert-parallel size ``EP``, EP rank ``r`` holds the
``E / EP`` experts ``r * E/EP .. (r+1) * E/EP - 1`` under *local* indices ``0 .. E/EP - 1``
(megatron-core's ``local_expert_indices_offset``); the file of (TP rank t, PP rank p, EP rank r)
holds every other tensor as the EP-free layout does. Canonical names always carry the global
index (``mlp.experts.{e}.``): :func:`slots_of_ep_rank` maps a chunk's slots to one EP rank's
file, :func:`globalise` maps one file's tensors back.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from pretrain.checkpoint.plan import Slot
from pretrain.checkpoint.types import TensorSource
from pretrain.checkpoint.upstream.expert_names import OUR_EXPERT, split_grouped
from pretrain.config import ModelConfig
from pretrain.models.moe.router import check_router_weight
from pretrain.parallel.config import ParallelConfig
from pretrain.utils.errors import UserError

# a routed expert in any per-layer file naming: SequentialMLP, TE grouped, ours (legacy names)
_FILE_EXPERT = re.compile(
    r"(\.mlp\.experts\.(?:local_experts\.)?)(\d+)(\.)|(\.mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$"
)


def experts_per_rank(cfg: ModelConfig, ep: int, *, what: str = "--ep") -> int:
    """``E / EP``, the experts of each EP rank (one line if ``EP`` does not divide ``E``)."""
    if ep == 1:
        return int(cfg.num_experts or 0)
    if cfg.num_experts is None:
        raise UserError(f"{what} {ep}: the model has no experts (expert parallelism needs --num-experts)")
    if cfg.num_experts % ep:
        raise UserError(f"{what} {ep}: does not divide num_experts {cfg.num_experts}")
    return cfg.num_experts // ep


def check_expert_layout(cfg: ModelConfig, parallel: ParallelConfig, *, legacy: bool) -> None:
    """Refuse an EP/ETP layout the model or the format cannot hold (one line, before any work)."""
    experts_per_rank(cfg, parallel.ep)
    etp = parallel.expert_tp
    if parallel.etp is not None and cfg.num_experts is None:
        raise UserError(f"--etp {etp}: the model has no experts")
    if cfg.num_experts is not None and cfg.moe_ffn_size % etp:
        raise UserError(f"--etp {etp}: does not divide moe_ffn_hidden_size {cfg.moe_ffn_size}")
    if legacy and parallel.tp % etp:
        # rank files are named by TP, PP and EP rank only (Megatron's get_checkpoint_name): TP rank
        # t's file holds expert-TP shard t % ETP, one shard per file only when ETP divides TP
        raise UserError(
            f"--etp {etp} does not divide --tp {parallel.tp}: legacy torch rank files are named by TP, PP "
            "and EP rank only and cannot hold such expert shards; use --ckpt-format torch_dist"
        )


def expert_index(name: str) -> int | None:
    """The expert index in one of our names (``mlp.experts.{e}.``), or None."""
    m = OUR_EXPERT.search(name)
    return None if m is None else int(m.group(1))


def renumber_expert(name: str, offset: int) -> str:
    """``name`` with its expert index moved by ``offset`` (local <-> global)."""
    m = OUR_EXPERT.search(name)
    assert m is not None
    return f"{name[: m.start(1)]}{int(m.group(1)) + offset}{name[m.end(1) :]}"


def slots_of_ep_rank(slots: list[Slot], *, ep_rank: int, per_rank: int) -> list[Slot]:
    """The slots of EP rank ``ep_rank``'s file: every non-expert slot, and its own experts with
    local indices (``local`` renamed; ``canonical`` keeps the global index)."""
    lo = ep_rank * per_rank
    out = []
    for slot in slots:
        e = expert_index(slot.local)
        if e is None:
            out.append(slot)
        elif lo <= e < lo + per_rank:
            out.append(dataclasses.replace(slot, local=renumber_expert(slot.local, -lo)))
    return out


def globalise(
    flat: dict[str, torch.Tensor], *, ep_rank: int, per_rank: int, hidden: int, path: Path
) -> dict[str, torch.Tensor]:
    """One EP rank file's flat tensors with global expert indices (GroupedMLP pairs split into
    experts first). A local index past ``per_rank``: one line naming the tensor."""
    if per_rank == 0:
        return flat
    flat = split_grouped(flat, local_experts=per_rank, hidden=hidden, where=str(path))
    lo = ep_rank * per_rank
    out: dict[str, torch.Tensor] = {}
    for key, t in flat.items():
        m = _FILE_EXPERT.search(key)
        if m is not None:
            i = int(m.group(2) if m.group(2) is not None else m.group(5))
            if i >= per_rank:
                raise UserError(
                    f"{path}: tensor {key} is expert {i} of an EP rank that holds {per_rank} "
                    f"(num_experts / expert_model_parallel_size)"
                )
            group = 2 if m.group(2) is not None else 5
            key = f"{key[: m.start(group)]}{i + lo}{key[m.end(group) :]}"
        out[key] = t
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertShare:
    """The routed experts one expert-parallel rank of a run keeps: EP rank ``rank`` of ``size``
    holds global experts ``[rank E/size, (rank+1) E/size)`` (megatron-core's layout). Readers given
    a share read only those experts' tensors (and, for legacy files, only the files holding them);
    every other tensor is read as without one."""

    rank: int
    size: int

    def experts(self, num_experts: int | None) -> range | None:
        """The global indices kept, or ``None`` (all: a dense model). One line if ``size`` does not
        divide ``num_experts`` (the wording of the engine's own check)."""
        if not num_experts:
            return None
        if num_experts % self.size:
            raise UserError(
                f"--num-experts {num_experts} is not divisible by --expert-model-parallel-size {self.size}"
            )
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def keeps(self, name: str, num_experts: int | None) -> bool:
        """Whether tensor ``name`` (our names: ``mlp.experts.{e}.``, global ``e``) is read."""
        kept, e = self.experts(num_experts), expert_index(name)
        return kept is None or e is None or e in kept

    def file_ranks(self, num_experts: int, file_ep: int) -> list[int]:
        """The EP ranks of a checkpoint written with ``file_ep`` whose files hold a kept expert."""
        kept = self.experts(num_experts)
        per = num_experts // file_ep
        return [r for r in range(file_ep) if kept is None or set(range(r * per, (r + 1) * per)) & set(kept)]


def check_routers(source: TensorSource, *, where: str) -> None:
    """Every MoE router of ``source`` read now (``[E, h]`` each, small) and an all-zero one refused
    (:func:`~pretrain.models.moe.router.check_router_weight`), before a conversion writes anything."""
    if source.spec.cfg.num_experts is None:
        return
    for name in source.names():
        if name.endswith(".mlp.router.weight"):
            check_router_weight(f"{where}: {name}", source.tensor(name))
