"""What a model family or finetuning task plugs into the one training loop.

The loop owns parallel state, optimizer, schedules, logging and checkpoints; a task says how to
build the model chunks, how one pipeline stage runs a microbatch, where batches come from, and
how the loss is normalised so that every layout computes one process's loss.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from pretrain.config import ModelConfig
from pretrain.models.base import ShardedModule
from pretrain.parallel.state import ParallelState
from pretrain.training.config import TrainingConfig

Microbatch = dict[str, torch.Tensor]


class TrainTask(Protocol):
    """The plug-in interface of :func:`pretrain.training.loop.train`."""

    model_type: str
    model_cfg: ModelConfig
    loss_names: tuple[str, ...]  # the named loss parts :meth:`loss` reports, in a fixed order

    def build_chunks(self, ps: ParallelState) -> list[ShardedModule]:
        """This rank's model chunks (``model0..modelV-1``), parameters not yet initialised."""
        ...

    def forward_step(
        self, model: ShardedModule, mb: Microbatch, hidden: torch.Tensor | None, is_last: bool
    ) -> Any:
        """Run one stage on one microbatch (see :func:`pretrain.pipeline.schedules.forward_backward`)."""
        ...

    def microbatches(self, split: str, index: int, ps: ParallelState) -> list[Microbatch]:
        """This data-parallel rank's microbatches of global batch ``index`` of ``split``."""
        ...

    def normalizers(self, mbs: list[Microbatch], ps: ParallelState) -> dict[str, float]:
        """Global-batch counts the losses are divided by (collective over the DP group)."""
        ...

    def loss(
        self, output: Any, mb: Microbatch, norms: dict[str, float]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss to back-propagate, named parts for logging)``; both already normalised."""
        ...

    def flops_per_iteration(self, global_batch: int) -> float:
        """Model FLOPs of one training iteration (for TFLOP/s logging)."""
        ...


# Optional: a task may define ``load_initial_weights(chunks, ps)``; the loop calls it after the
# seeded initialisation and before the optimizer copies the parameters (finetuning loads the
# pretrained trunk there, the fresh head keeps its seeded initial values).


def dp_microbatches(dataset: Any, index: int, cfg: TrainingConfig, ps: ParallelState) -> list[Microbatch]:
    """This DP rank's microbatches of global batch ``index`` of ``dataset`` (samples are dicts).

    The global batch is samples ``[index * G, (index + 1) * G)`` (wrapping around the dataset),
    cut into ``d`` contiguous per-rank slices and then into microbatches of ``micro_batch_size``.
    """
    from pretrain.data.gpt_dataset import collate_samples, global_batch_indices

    idx = global_batch_indices(index, cfg.global_batch_size, ps.dp_rank, ps.dp_size)
    batch = collate_samples([dataset[int(i) % len(dataset)] for i in idx])
    m, b = cfg.num_microbatches(ps.dp_size), cfg.micro_batch_size
    return [{k: v[i * b : (i + 1) * b] for k, v in batch.items()} for i in range(m)]
