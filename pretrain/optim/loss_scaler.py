"""Loss scalers for fp16 training (Megatron-LM's ``ConstantGradScaler`` / ``DynamicGradScaler``).

The loss is multiplied by ``scale`` before backward and gradients are divided by it before the
optimizer step. A step whose gradients contain inf/nan is skipped (the optimizer decides; the
scaler only adjusts ``scale``).

Dynamic rule (as Megatron): on overflow the growth counter resets and the hysteresis counter
drops by one; once it reaches zero the scale is multiplied by ``backoff_factor`` (never below
``min_scale``) on this and every further overflow until the scale grows again. After
``growth_interval`` consecutive clean steps the scale is multiplied by ``growth_factor`` and
the hysteresis counter is refilled.
"""

from __future__ import annotations

from typing import Any

from pretrain.optim.config import OptimizerConfig
from pretrain.utils.errors import UserError


class LossScaler:
    """Interface: ``scale`` (float), ``update(found_inf)``, ``state_dict``/``load_state_dict``."""

    scale: float

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


class ConstantLossScaler(LossScaler):
    """A fixed scale; overflowing steps are still skipped."""

    def __init__(self, scale: float) -> None:
        if scale <= 0:
            raise UserError(f"loss_scale must be > 0, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler(LossScaler):
    """Grow after ``growth_interval`` clean steps, back off after ``hysteresis`` overflows."""

    def __init__(
        self,
        *,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        if not (0 < min_scale <= initial_scale):
            raise UserError(f"need 0 < min_loss_scale {min_scale} <= initial_loss_scale {initial_scale}")
        if growth_interval < 1 or hysteresis < 1:
            raise UserError("loss_scale_window and hysteresis must be >= 1")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def build_loss_scaler(config: OptimizerConfig) -> LossScaler | None:
    """Constant when ``loss_scale`` is set, dynamic for fp16, none otherwise (bf16/fp32)."""
    if config.loss_scale is not None:
        return ConstantLossScaler(config.loss_scale)
    if not config.fp16:
        return None
    return DynamicLossScaler(
        initial_scale=config.initial_loss_scale,
        min_scale=config.min_loss_scale,
        growth_factor=config.growth_factor,
        backoff_factor=config.backoff_factor,
        growth_interval=config.loss_scale_window,
        hysteresis=config.hysteresis,
    )
