"""What each rank file of a layout holds: local names, canonical names, split dims, shard shapes.

The plan is read off our own model classes built on the ``meta`` device (no memory, no
communication), so resharding, upstream reading and the models can never disagree about names
or about which tensors are split along which dimension.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pretrain.config import ModelConfig
from pretrain.models.base import ShardedModule
from pretrain.models.kinds import KINDS, ModelKind, kind_of
from pretrain.models.sharding import RowLayout, is_vocab_tensor, row_layout
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.layout import compute_layout
from pretrain.parallel.state import ParallelState
from pretrain.pipeline.partition import StageLayers, stage_layer_numbers
from pretrain.tensor_parallel.layers import is_expert, partition_dim

MODEL_KINDS = tuple(KINDS)  # the recorded kind names (pretrain.models.kinds)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Which model a checkpoint holds: ``kind`` (gpt or bert), its config, BERT's binary head.

    ``fresh_heads`` names heads initialised on import because the source model had none (a bare
    HF ``BertModel``: ``"lm_head"``, ``"binary_head"``); exports leave them out."""

    kind: str
    cfg: ModelConfig
    add_binary_head: bool = True
    fresh_heads: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        kind_of(self.kind, where="model spec")

    @property
    def model_kind(self) -> ModelKind:
        """What the recorded ``kind`` implies (:mod:`pretrain.models.kinds`)."""
        return kind_of(self.kind)


@dataclass(frozen=True)
class Slot:
    """One tensor of one rank file: local name, canonical name, TP split dim, shard shape."""

    local: str
    canonical: str
    dim: int | None
    shape: tuple[int, ...]
    vocab: bool  # rows are the padded vocabulary
    layout: RowLayout | None = None  # SwiGLU / GQA row structure (see pretrain.models.sharding)
    # distinct shards along ``dim`` when not the layout's TP: a routed expert at an expert-TP size
    # ETP dividing TP, whose TP rank t's file holds ETP shard ``t % ETP`` (megatron-core's ranks)
    shards: int | None = None


def meta_chunk(
    spec: ModelSpec,
    *,
    tp: int,
    pre_process: bool,
    post_process: bool,
    layer_numbers: Sequence[int],
    etp: int | None = None,
) -> ShardedModule:
    """A model chunk of the given layout on the meta device (shapes and names only); routed
    experts split ``etp`` ways (``None``: like TP)."""
    world = math.lcm(tp, etp or tp)
    lay = compute_layout(world_size=world, tp=tp, pp=1, etp=etp)
    ps = ParallelState(layout=lay, rank=0, device=torch.device("meta"))
    return spec.model_kind.build(
        spec.cfg, ps, add_binary_head=spec.add_binary_head, pre_process=pre_process,
        post_process=post_process, layer_numbers=list(layer_numbers),
    )  # fmt: skip


def chunk_slots(
    spec: ModelSpec,
    *,
    tp: int,
    pre_process: bool,
    post_process: bool,
    layer_numbers: Sequence[int],
    etp: int | None = None,
) -> list[Slot]:
    """The tensors of one chunk at tensor-parallel size ``tp`` (same on every TP rank); routed
    experts at expert-TP size ``etp`` when given and not ``tp`` (:attr:`Slot.shards`)."""
    etp = None if etp == tp else etp
    chunk = meta_chunk(
        spec, tp=tp, pre_process=pre_process, post_process=post_process, layer_numbers=layer_numbers, etp=etp
    )
    return [
        Slot(
            name,
            chunk.canonical_name(name),
            partition_dim(p),
            tuple(p.shape),
            is_vocab_tensor(name),
            row_layout(name, spec.cfg),
            etp if etp is not None and is_expert(p) else None,
        )  # fmt: skip
        for name, p in chunk.named_parameters()
    ]


@dataclass(frozen=True, kw_only=True)
class LayoutPlan:
    """Layers and tensors of every ``[stage][chunk]`` of a layout."""

    spec: ModelSpec
    tp: int
    pp: int
    vp: int
    layers: StageLayers
    etp: int | None = None  # routed experts' TP size when not ``tp``

    @classmethod
    def for_parallel(cls, spec: ModelSpec, parallel: ParallelConfig) -> LayoutPlan:
        spec.cfg.check_tensor_parallel(parallel.tp)
        layers = stage_layer_numbers(
            spec.cfg.num_layers,
            pp=parallel.pp,
            vp=parallel.vp,
            first=parallel.num_layers_in_first_stage,
            last=parallel.num_layers_in_last_stage,
        )
        etp = parallel.expert_tp if spec.cfg.num_experts else None
        return cls(spec=spec, tp=parallel.tp, pp=parallel.pp, vp=parallel.vp, layers=layers, etp=etp)

    def is_pre(self, stage: int, chunk: int) -> bool:
        return stage == 0 and chunk == 0

    def is_post(self, stage: int, chunk: int) -> bool:
        return stage == self.pp - 1 and chunk == self.vp - 1

    def slots(self, stage: int, chunk: int) -> list[Slot]:
        return chunk_slots(
            self.spec,
            tp=self.tp,
            pre_process=self.is_pre(stage, chunk),
            post_process=self.is_post(stage, chunk),
            layer_numbers=self.layers[stage][chunk],
            etp=self.etp,
        )

    def chunk_keys(self) -> list[str]:
        """``model`` or ``model0 .. modelV-1``: the entries of a rank file holding chunks."""
        return ["model"] if self.vp == 1 else [f"model{c}" for c in range(self.vp)]


def layers_from_counts(counts: list[list[int]]) -> StageLayers:
    """Global layer numbers from per-``[stage][chunk]`` layer counts.

    Layers run chunk-major across stages (chunk 0 of every stage, then chunk 1, ...), which is
    Megatron's interleaved assignment and, for one chunk, plain consecutive (possibly uneven)
    stages.
    """
    pp, vp = len(counts), len(counts[0])
    out: StageLayers = [[[] for _ in range(vp)] for _ in range(pp)]
    start = 0
    for c in range(vp):
        for s in range(pp):
            out[s][c] = list(range(start, start + counts[s][c]))
            start += counts[s][c]
    return out
