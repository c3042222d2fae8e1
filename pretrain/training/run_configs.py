"""Every validated config of one ``mlm-pretrain`` run, as one typed record passed between layers."""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.config import ModelConfig
from pretrain.data.gpt_dataset import GPTDatasetConfig
from pretrain.optim.config import LRScheduleConfig, OptimizerConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.tokenizer.base import Tokenizer
from pretrain.tokenizer.factory import TokenizerConfig
from pretrain.training.config import TrainingConfig


@dataclass(frozen=True, kw_only=True)
class PretrainConfigs:
    """What :func:`pretrain.training.cli.configs_from_args` derives from the flags (no process
    group needed): the model kind's name (``gpt``, ``bert``), tokenizer, layout, model, loop,
    optimizer, LR schedule and data."""

    kind: str
    tokenizer_cfg: TokenizerConfig
    tokenizer: Tokenizer
    parallel: ParallelConfig
    model: ModelConfig
    train: TrainingConfig
    optim: OptimizerConfig
    lr: LRScheduleConfig
    data: GPTDatasetConfig
