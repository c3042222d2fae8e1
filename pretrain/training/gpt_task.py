"""GPT pretraining as a :class:`~pretrain.training.task.TrainTask`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pretrain.config import ModelConfig
from pretrain.data.gpt_dataset import (
    GPTDatasetConfig,
    build_gpt_datasets,
)
from pretrain.distributed.ddp import global_loss_tokens
from pretrain.models.base import ShardedModule
from pretrain.models.gpt import GPTModel
from pretrain.parallel.state import ParallelState
from pretrain.pipeline.partition import build_model_chunks
from pretrain.pipeline.schedules import gpt_forward_step
from pretrain.tensor_parallel.vocab import padded_vocab_size
from pretrain.training.config import TrainingConfig
from pretrain.training.flops import gpt_flops_per_iteration
from pretrain.training.task import Microbatch, dp_microbatches
from pretrain.utils.errors import UserError


@dataclass(kw_only=True)
class GPTTask:
    """Next-token prediction on GPT samples; the loss is the token mean over the global batch."""

    model_cfg: ModelConfig
    data_cfg: GPTDatasetConfig
    train_cfg: TrainingConfig
    model_type: str = "gpt"
    loss_names: tuple[str, ...] = ("lm loss",)
    datasets: dict[str, Any] = field(default_factory=dict)

    def build_chunks(self, ps: ParallelState) -> list[ShardedModule]:
        return build_model_chunks(self.model_cfg, ps, GPTModel)

    def forward_step(
        self, model: ShardedModule, mb: Microbatch, hidden: torch.Tensor | None, is_last: bool
    ) -> Any:
        return gpt_forward_step(model, mb, hidden, is_last)

    def build_datasets(self) -> None:
        t = self.train_cfg
        evals = (t.train_iters // t.eval_interval + 1) * t.eval_iters if t.eval_interval else 0
        train, valid, test = build_gpt_datasets(
            self.data_cfg, [t.train_iters * t.global_batch_size, evals * t.global_batch_size, None]
        )
        self.datasets = {"train": train, "valid": valid, "test": test}

    def microbatches(self, split: str, index: int, ps: ParallelState) -> list[Microbatch]:
        if not self.datasets:
            self.build_datasets()
        ds = self.datasets.get(split)
        if ds is None:
            raise UserError(f"--split {self.data_cfg.split} leaves no {split} documents in --data-path")
        return dp_microbatches(ds, index, self.train_cfg, ps)

    def normalizers(self, mbs: list[Microbatch], ps: ParallelState) -> dict[str, float]:
        return {"tokens": global_loss_tokens([mb["loss_mask"] for mb in mbs], ps)}

    def loss(
        self, output: Any, mb: Microbatch, norms: dict[str, float]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = (output.float() * mb["loss_mask"]).sum() / max(norms["tokens"], 1.0)
        return loss, {"lm loss": loss.detach()}

    def flops_per_iteration(self, global_batch: int) -> float:
        padded = padded_vocab_size(
            self.model_cfg.vocab_size, tp=1, divisible_by=self.model_cfg.make_vocab_size_divisible_by
        )
        return gpt_flops_per_iteration(self.model_cfg, global_batch=global_batch, seq_length=self.train_cfg.seq_length,
                                       padded_vocab=padded)  # fmt: skip
