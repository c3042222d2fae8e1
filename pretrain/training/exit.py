"""When to stop early: Megatron's ``--exit-interval``, ``--exit-duration-in-mins``, ``--exit-signal-handler``.

Checked after every iteration. Under ``torch.distributed`` the decision is one ``all_reduce``
(MAX over the default group) of a 0/1 flag, so every rank stops after the same iteration even when
only some received the signal or crossed the time limit; without any exit flag nothing is
communicated. The loop then saves a checkpoint (with ``--save``) and returns normally.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from types import FrameType

import torch
import torch.distributed as dist

from pretrain.training.config import TrainingConfig


class ExitConditions:
    """Tracks the stop conditions of one run; use :meth:`handling_signals` around the loop."""

    def __init__(self, cfg: TrainingConfig, device: torch.device | None = None) -> None:
        self.cfg, self.device = cfg, device or torch.device("cpu")
        self.start = time.monotonic()
        self.signalled = False
        self.reason: str | None = None

    @property
    def active(self) -> bool:
        return bool(self.cfg.exit_interval or self.cfg.exit_duration_in_mins or self.cfg.exit_signal_handler)

    @contextlib.contextmanager
    def handling_signals(self) -> Iterator[None]:
        """With ``--exit-signal-handler``: SIGTERM sets a flag instead of killing the process."""
        if not self.cfg.exit_signal_handler:
            yield
            return

        def on_term(signum: int, frame: FrameType | None) -> None:
            self.signalled = True

        previous = signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def should_exit(self, done: int) -> bool:
        """True (on every rank alike) when training should stop after iteration ``done``."""
        if not self.active:
            return False
        reasons = []
        if self.cfg.exit_interval and done % self.cfg.exit_interval == 0:
            reasons.append(f"--exit-interval {self.cfg.exit_interval}")
        minutes = (time.monotonic() - self.start) / 60.0
        if self.cfg.exit_duration_in_mins and minutes >= self.cfg.exit_duration_in_mins:
            reasons.append(f"--exit-duration-in-mins {self.cfg.exit_duration_in_mins:g}")
        if self.signalled:
            reasons.append("SIGTERM")
        flag = torch.tensor([1.0 if reasons else 0.0], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            self.reason = ", ".join(reasons) or "another rank's exit condition"
            return True
        return False
