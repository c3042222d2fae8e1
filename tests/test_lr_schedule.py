"""Learning-rate schedule: warmup, cosine / linear / constant decay, samples, state round trip."""

from __future__ import annotations

import math

import pytest

from pretrain.optim import LRScheduleConfig, LRScheduler, lr_at
from pretrain.utils.errors import UserError


class _Opt:
    lr = -1.0

    def set_lr(self, lr: float) -> None:
        self.lr = lr


def test_paper_schedule_warmup_then_cosine() -> None:
    cfg = LRScheduleConfig(lr=1.5e-4, min_lr=1e-5, warmup_iters=3000, decay_iters=300_000)
    assert lr_at(cfg, 0) == 0.0
    assert lr_at(cfg, 1500) == pytest.approx(0.75e-4)
    assert lr_at(cfg, 3000) == pytest.approx(1.5e-4)
    mid = 3000 + (300_000 - 3000) // 2
    assert lr_at(cfg, mid) == pytest.approx(1e-5 + 0.5 * 1.4e-4, rel=1e-6)
    assert lr_at(cfg, 300_000) == pytest.approx(1e-5)
    assert lr_at(cfg, 10**7) == 1e-5
    quarter = 3000 + (300_000 - 3000) / 4
    assert lr_at(cfg, int(quarter)) == pytest.approx(
        1e-5 + 1.4e-4 * 0.5 * (1 + math.cos(math.pi / 4)), rel=1e-4
    )


def test_linear_and_constant() -> None:
    lin = LRScheduleConfig(lr=1.0, min_lr=0.0, decay_style="linear", warmup_iters=10, decay_iters=110)
    assert lr_at(lin, 5) == 0.5 and lr_at(lin, 60) == pytest.approx(0.5) and lr_at(lin, 110) == 0.0
    const = LRScheduleConfig(lr=2.0, min_lr=0.0, decay_style="constant", warmup_iters=4)
    assert lr_at(const, 2) == 1.0 and lr_at(const, 4) == 2.0 and lr_at(const, 10**6) == 2.0


def test_samples_scheduler_pushes_lr_and_round_trips() -> None:
    cfg = LRScheduleConfig(lr=1.0, min_lr=0.1, warmup_samples=64, decay_samples=640, decay_style="linear")
    opt = _Opt()
    sched = LRScheduler(cfg, opt)
    assert opt.lr == 0.0
    for _ in range(3):
        sched.step(increment=16)  # global batch of 16 samples
    assert sched.num_steps == 48 and opt.lr == pytest.approx(0.75)
    state = sched.state_dict()
    other = LRScheduler(cfg, _Opt())
    other.load_state_dict(state)
    assert other.num_steps == 48 and other.optimizer.lr == pytest.approx(0.75)
    changed = LRScheduler(LRScheduleConfig(lr=2.0, min_lr=0.1, warmup_samples=64, decay_samples=640))
    with pytest.raises(UserError, match="lr"):
        changed.load_state_dict(state)
    changed.load_state_dict(state, override=True)
    assert changed.num_steps == 48


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"warmup_iters": 10, "decay_samples": 100}, "not both"),
        ({"decay_style": "cosine"}, "needs decay_iters"),
        ({"warmup_iters": 10, "decay_iters": 10}, "must exceed"),
        ({"lr": 1e-5, "min_lr": 1e-4, "decay_iters": 10}, "min_lr"),
        ({"decay_style": "step", "decay_iters": 10}, "decay_style"),
    ],
)
def test_invalid_configs(kw: dict, match: str) -> None:
    with pytest.raises(UserError, match=match):
        LRScheduleConfig(**kw)
