"""Optimizer, mixed-precision, loss-scaling and learning-rate-schedule configuration.

Defaults follow the paper (AdamW, weight decay 0.01, clip 1.0) and Megatron-LM's flags
(``--fp16``/``--bf16``, ``--initial-loss-scale 2**32``, ``--loss-scale-window 1000``,
``--hysteresis 2``, ``--min-loss-scale 1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from pretrain.utils.errors import UserError

DecayStyle = Literal["cosine", "linear", "constant"]


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with optional fp16/bf16 model parameters, loss scaling, clipping and ZeRO-1.

    * ``fp16``/``bf16``: model parameters in half precision; the optimizer keeps fp32 main
      parameters and steps them in fp32. Neither: fp32 parameters (they are the main parameters).
    * Loss scaling: ``loss_scale`` set = constant scale; otherwise dynamic when ``fp16`` (none for
      bf16/fp32). Dynamic: start at ``initial_loss_scale``, multiply by ``growth_factor`` after
      ``loss_scale_window`` clean steps, multiply by ``backoff_factor`` after ``hysteresis``
      overflowing steps, never below ``min_loss_scale``.
    * ``clip_grad``: max global gradient norm (0 disables), ``clip_norm_type`` 2 or inf.
    """

    lr: float = 1.5e-4
    min_lr: float = 1.0e-5
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    clip_norm_type: float = 2.0
    use_distributed_optimizer: bool = False
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    backoff_factor: float = 0.5
    growth_factor: float = 2.0
    log_num_zeros_in_grad: bool = False
    use_apex_adam: bool = True  # use apex FusedAdam when importable (CUDA only); else torch AdamW

    def __post_init__(self) -> None:
        if self.fp16 and self.bf16:
            raise UserError("optimizer config: --fp16 and --bf16 are mutually exclusive")
        if self.lr < 0 or self.min_lr < 0:
            raise UserError(f"optimizer config: lr {self.lr} and min_lr {self.min_lr} must be >= 0")
        if self.weight_decay < 0:
            raise UserError(f"optimizer config: weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"optimizer config: {name} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise UserError(f"optimizer config: adam_eps must be > 0, got {self.adam_eps}")
        if self.clip_grad < 0:
            raise UserError(f"optimizer config: clip_grad must be >= 0, got {self.clip_grad}")
        if self.clip_norm_type not in (2.0, math.inf):
            raise UserError(f"optimizer config: clip_norm_type must be 2 or inf, got {self.clip_norm_type}")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise UserError(f"optimizer config: loss_scale must be > 0, got {self.loss_scale}")
        if self.min_loss_scale <= 0 or self.initial_loss_scale < self.min_loss_scale:
            raise UserError(
                f"optimizer config: need 0 < min_loss_scale {self.min_loss_scale} <= "
                f"initial_loss_scale {self.initial_loss_scale}"
            )
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise UserError("optimizer config: loss_scale_window and hysteresis must be >= 1")
        if not 0.0 < self.backoff_factor < 1.0 or self.growth_factor <= 1.0:
            raise UserError("optimizer config: need 0 < backoff_factor < 1 < growth_factor")

    @property
    def params_dtype(self) -> torch.dtype:
        """Dtype of the model parameters this configuration expects."""
        if self.fp16:
            return torch.float16
        return torch.bfloat16 if self.bf16 else torch.float32


@dataclass(frozen=True, kw_only=True)
class LRScheduleConfig:
    """Linear warmup to ``lr`` then ``decay_style`` decay to ``min_lr`` (paper: 1.5e-4, 3k warmup,
    cosine to 1e-5).

    Count either iterations (``warmup_iters``/``decay_iters``) or samples
    (``warmup_samples``/``decay_samples``), not both. ``decay_*`` is the step (or sample) count at
    which the decay ends, measured from 0 (warmup included), as in Megatron-LM.
    """

    lr: float = 1.5e-4
    min_lr: float = 1.0e-5
    decay_style: DecayStyle = "cosine"
    warmup_iters: int = 0
    decay_iters: int | None = None
    warmup_samples: int = 0
    decay_samples: int | None = None

    def __post_init__(self) -> None:
        if self.decay_style not in ("cosine", "linear", "constant"):
            raise UserError(
                f"lr schedule: decay_style must be cosine|linear|constant, got {self.decay_style!r}"
            )
        if not 0.0 <= self.min_lr <= self.lr:
            raise UserError(f"lr schedule: need 0 <= min_lr {self.min_lr} <= lr {self.lr}")
        by_iters = self.warmup_iters > 0 or self.decay_iters is not None
        by_samples = self.warmup_samples > 0 or self.decay_samples is not None
        if by_iters and by_samples:
            raise UserError("lr schedule: give warmup/decay in iterations or in samples, not both")
        if self.warmup_iters < 0 or self.warmup_samples < 0:
            raise UserError("lr schedule: warmup_iters / warmup_samples must be >= 0")
        decay = self.decay_steps
        if self.decay_style != "constant" and decay is None:
            raise UserError(
                f"lr schedule: decay_style {self.decay_style!r} needs decay_iters or decay_samples"
            )
        if decay is not None and decay <= self.warmup_steps:
            raise UserError(
                f"lr schedule: decay_{self.unit} {decay} must exceed warmup_{self.unit} {self.warmup_steps}"
            )

    @property
    def by_samples(self) -> bool:
        return self.warmup_samples > 0 or self.decay_samples is not None

    @property
    def unit(self) -> str:
        return "samples" if self.by_samples else "iters"

    @property
    def warmup_steps(self) -> int:
        return self.warmup_samples if self.by_samples else self.warmup_iters

    @property
    def decay_steps(self) -> int | None:
        return self.decay_samples if self.by_samples else self.decay_iters
