"""A BERT finetuning run's hyperparameters: the paper's Table 6 preset with Megatron-named flags on top."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from finetune.presets import get_preset
from pretrain.utils.errors import UserError


@dataclass(frozen=True, kw_only=True)
class Hyperparameters:
    """A finetuning run's hyperparameters: the ``--preset``'s values with the flags given on top."""

    epochs: float
    global_batch_size: int
    lr: float
    seq_length: int
    warmup: float  # fraction of the iterations
    weight_decay: float

    def check(self, seeds: int) -> None:
        """Each value in its range, named by its flag (one line, exit 2)."""
        for flag, value, ok, rule in (
            ("--epochs", self.epochs, self.epochs > 0, "> 0"),
            ("--seeds", seeds, seeds >= 1, ">= 1"),
            ("--lr-warmup-fraction", self.warmup, 0.0 <= self.warmup < 1.0, "in [0, 1)"),
            ("--global-batch-size", self.global_batch_size, self.global_batch_size >= 1, ">= 1"),
            ("--seq-length", self.seq_length, self.seq_length >= 1, ">= 1"),
            ("--lr", self.lr, self.lr >= 0, ">= 0"),
        ):
            if not ok:
                raise UserError(f"{flag} must be {rule}, got {value}")


def hyperparameters_from_args(args: argparse.Namespace) -> Hyperparameters:
    """Preset values with the flags that were given on top, checked."""
    preset = get_preset(args.task, args.preset)

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    h = Hyperparameters(
        epochs=given(args.epochs, preset.epochs),
        global_batch_size=given(args.global_batch_size, preset.global_batch_size),
        lr=given(args.lr, preset.lr),
        seq_length=given(args.seq_length, preset.seq_length),
        warmup=given(args.lr_warmup_fraction, preset.warmup_fraction),
        weight_decay=given(args.weight_decay, preset.weight_decay),
    )
    h.check(args.seeds)
    return h
