"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to ``min_lr``.

Megatron-LM's ``OptimizerParamScheduler`` rule with ``n`` = steps (iterations, or samples when
the config counts samples), W = warmup, D = decay end:

* ``n <= W`` (W > 0): ``lr * n / W``;
* constant style: ``lr``; ``n > D``: ``min_lr``;
* else with ``r = (n - W) / (D - W)``: linear ``min + (lr - min) (1 - r)``, cosine
  ``min + (lr - min) (1 + cos(pi r)) / 2``.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from pretrain.optim.config import LRScheduleConfig
from pretrain.utils.errors import UserError


class _HasSetLR(Protocol):
    def set_lr(self, lr: float) -> None: ...


def lr_at(config: LRScheduleConfig, num_steps: int) -> float:
    """The learning rate after ``num_steps`` iterations (or samples)."""
    warmup, decay = config.warmup_steps, config.decay_steps
    if warmup > 0 and num_steps <= warmup:
        return config.lr * num_steps / warmup
    if config.decay_style == "constant" or decay is None:
        return config.lr
    if num_steps > decay:
        return config.min_lr
    ratio = (num_steps - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if config.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return config.min_lr + coeff * (config.lr - config.min_lr)


class LRScheduler:
    """Tracks ``num_steps`` and pushes the current lr into ``optimizer.set_lr`` on every step.

    ``step(increment)``: ``increment`` is 1 per iteration, or the global batch size (samples)
    when the schedule counts samples. Only successful optimizer steps should advance it.
    """

    _CHECKED = ("lr", "min_lr", "decay_style", "warmup_steps", "decay_steps", "by_samples")

    def __init__(self, config: LRScheduleConfig, optimizer: _HasSetLR | None = None) -> None:
        self.config, self.optimizer = config, optimizer
        self.num_steps = 0
        self._apply()

    @property
    def lr(self) -> float:
        return lr_at(self.config, self.num_steps)

    def _apply(self) -> None:
        if self.optimizer is not None:
            self.optimizer.set_lr(self.lr)

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        self._apply()
        return self.lr

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {name: getattr(self.config, name) for name in self._CHECKED}
        state["num_steps"] = self.num_steps
        return state

    def load_state_dict(self, state: dict[str, Any], *, override: bool = False) -> None:
        """Restore ``num_steps``; unless ``override``, the saved schedule must match the config."""
        if not override:
            for name in self._CHECKED:
                if name in state and state[name] != getattr(self.config, name):
                    raise UserError(
                        f"lr schedule: checkpoint has {name}={state[name]!r} but the config says "
                        f"{getattr(self.config, name)!r} (pass override to use the config)"
                    )
        self.num_steps = int(state["num_steps"])
        self._apply()
