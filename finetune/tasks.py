"""Finetuning tasks as :class:`~pretrain.training.task.TrainTask` plug-ins of the one training loop.

A :class:`TaskData` family (:mod:`finetune.task_data`: GLUE classification/regression, SQuAD
spans, RACE multiple choice) turns official files into padded tensors, says how a microbatch's
head output becomes a loss and how predictions become official metrics and prediction files.
:class:`FinetuneTask` adds what every family shares: the BERT + head model chunks, loading the
pretrained trunk, epoch-shuffled global batches, the global-batch loss normalisation, and
:func:`predict`, which runs the forward-only pipeline schedule over an evaluation split and
gathers the head outputs of every data-parallel rank.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from finetune.heads import HeadConfig
from finetune.init_from import load_trunk
from finetune.model import finetune_forward_step, finetune_model_provider
from pretrain.config import ModelConfig
from pretrain.data.gpt_dataset import global_batch_indices
from pretrain.models.base import ShardedModule
from pretrain.parallel.state import ParallelState
from pretrain.pipeline.partition import build_model_chunks
from pretrain.pipeline.schedules import forward_backward
from pretrain.training.config import TrainingConfig
from pretrain.training.flops import gpt_flops_per_iteration
from pretrain.training.task import Microbatch
from pretrain.utils.errors import UserError

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]  # per-example tensors, first dimension = examples


class TaskData(Protocol):
    """One task family's data, loss and scoring (see :mod:`finetune.task_data`)."""

    name: str  # the CLI task name (mnli, squad, race, ...)
    head: HeadConfig
    loss_name: str
    train: Tensors
    eval_splits: dict[str, Tensors]  # every split that gets predictions, dev splits first

    def loss_sum(self, output: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        """Sum over the microbatch's examples of the per-example loss (fp32)."""
        ...

    def score(self, outputs: Mapping[str, np.ndarray], out_dir: str | None) -> dict[str, Any]:
        """``{"metrics": {...}, "details": {...}, "files": [...]}`` from head outputs per split;
        prediction files go to ``out_dir`` (when given)."""
        ...


def rows_to_microbatches(
    tensors: Tensors, rows: np.ndarray, micro: int, device: torch.device
) -> list[Microbatch]:
    """Microbatches of ``micro`` examples (last may be smaller); multiple-choice ``[n, c, s]``
    inputs are flattened to ``[n * c, s]`` (choices of one example consecutive)."""
    out = []
    index = torch.as_tensor(rows, dtype=torch.long)
    for start in range(0, len(rows), micro):
        mb = {}
        for key, t in tensors.items():
            part = t[index[start : start + micro]]
            if key in ("tokens", "tokentype_ids", "attention_mask") and part.dim() == 3:
                part = part.reshape(-1, part.shape[-1])
            mb[key] = part.to(device)
        out.append(mb)
    return out


def train_iterations(num_examples: int, epochs: float, global_batch: int) -> int:
    """Iterations that show every training example ``epochs`` times (at least one)."""
    if num_examples <= 0:
        raise UserError("the training split has no examples")
    return max(1, math.ceil(epochs * num_examples / global_batch))


@dataclass(kw_only=True)
class FinetuneTask:
    """The TrainTask of any family. ``pretrained``: canonical trunk tensors (None: weights come
    from ``--load`` in the training config, e.g. ``--eval-only``)."""

    data: TaskData
    model_cfg: ModelConfig
    train_cfg: TrainingConfig
    pretrained: Mapping[str, torch.Tensor] | None = None
    model_type: str = "bert"
    loss_names: tuple[str, ...] = ()
    fresh: list[str] = field(default_factory=list)
    _perms: dict[int, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.loss_names = (self.data.loss_name,)

    def build_chunks(self, ps: ParallelState) -> list[ShardedModule]:
        return build_model_chunks(self.model_cfg, ps, finetune_model_provider(self.data.head))

    def load_initial_weights(self, chunks: list[ShardedModule], ps: ParallelState) -> None:
        """Pretrained trunk into every chunk (the loop calls this before building the optimizer)."""
        if self.pretrained is None:
            return
        self.fresh = [name for c in chunks for name in load_trunk(c, self.pretrained)]

    def forward_step(
        self, model: ShardedModule, mb: Microbatch, hidden: torch.Tensor | None, is_last: bool
    ) -> Any:
        return finetune_forward_step(model, mb, hidden, is_last)

    def _epoch_perm(self, epoch: int, n: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms[epoch] = np.random.default_rng(self.train_cfg.seed + 7919 * epoch).permutation(n)
        return self._perms[epoch]

    def microbatches(self, split: str, index: int, ps: ParallelState) -> list[Microbatch]:
        """Train: global batch ``index`` of the epoch-shuffled stream; other splits: the first dev
        split in order, wrapping around (validation loss only)."""
        t = self.train_cfg
        tensors = self.data.train if split == "train" else next(iter(self.data.eval_splits.values()))
        n = len(tensors["tokens"])
        positions = global_batch_indices(index, t.global_batch_size, ps.dp_rank, ps.dp_size)
        if split == "train":
            rows = np.array([self._epoch_perm(int(p) // n, n)[int(p) % n] for p in positions])
        else:
            rows = positions % n
        t.num_microbatches(ps.dp_size)
        return rows_to_microbatches(tensors, rows, t.micro_batch_size, ps.device)

    def normalizers(self, mbs: list[Microbatch], ps: ParallelState) -> dict[str, float]:
        return {"samples": float(self.train_cfg.global_batch_size)}  # every global batch is full

    def loss(
        self, output: Any, mb: Microbatch, norms: dict[str, float]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = self.data.loss_sum(output, mb) / norms["samples"]
        return loss, {self.data.loss_name: loss.detach()}

    def flops_per_iteration(self, global_batch: int) -> float:
        seqs = global_batch * (self.data.head.num_choices if self.data.head.kind == "multichoice" else 1)
        return gpt_flops_per_iteration(self.model_cfg, global_batch=seqs, seq_length=self.train_cfg.seq_length,
                                       padded_vocab=0)  # fmt: skip


def _gather_rows(rows: np.ndarray, local: np.ndarray | None, n: int) -> np.ndarray:
    """Assemble ``[n, ...]`` from the ``(rows, outputs)`` of every rank holding outputs."""
    parts: list[Any] = [(rows, local)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (rows, local))
    held = [(r, o) for r, o in parts if o is not None]
    if not held:
        raise RuntimeError("no rank returned predictions")
    out = np.zeros((n, *held[0][1].shape[1:]), dtype=np.float32)
    for r, o in held:
        out[r] = o
    return out


@torch.no_grad()
def predict(chunks: list[ShardedModule], ps: ParallelState, tensors: Tensors, micro_batch: int) -> np.ndarray:
    """Head outputs ``[n, ...]`` (fp32) for every example of ``tensors``, dropout off.

    Each data-parallel rank runs the forward-only schedule on examples ``dp_rank::dp_size``; the
    last stage's TP-rank-0 outputs are all-gathered, so every rank returns the whole array.
    Collective over all ranks.
    """
    n = len(tensors["tokens"])
    rows = np.arange(ps.dp_rank, n, ps.dp_size)
    if len(rows) == 0:  # more DP ranks than examples: repeat one (dropped by the gather)
        rows = np.array([0])
    mbs = rows_to_microbatches(tensors, rows, micro_batch, ps.device)
    for c in chunks:
        c.eval()
    try:
        _, outs = forward_backward(
            chunks=chunks, ps=ps, microbatches=mbs, loss_fn=lambda out, mb: torch.zeros(()), forward_only=True,
            collect_outputs=True, forward_step=finetune_forward_step,
        )  # fmt: skip
    finally:
        for c in chunks:
            c.train()
    holds = ps.is_last_stage and ps.tp_rank == 0 and ps.dp_rank < n
    local = np.concatenate([o.float().cpu().numpy() for o in outs]) if holds else None
    return _gather_rows(rows, local, n)


def predict_all(
    chunks: list[ShardedModule], ps: ParallelState, data: TaskData, micro_batch: int
) -> dict[str, np.ndarray]:
    """:func:`predict` for every evaluation split of ``data``."""
    return {split: predict(chunks, ps, tensors, micro_batch) for split, tensors in data.eval_splits.items()}
