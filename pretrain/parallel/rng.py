"""Model-parallel random number generation (paper appendix B.2).

Dropout *outside* tensor-parallel regions (embeddings, residual dropout) must be identical on all
TP ranks, because every TP rank holds the same activations there: it uses the default generator,
seeded identically on every TP rank. Dropout *inside* TP regions (attention probabilities, whose
heads are split across ranks) must differ per rank: it runs under :meth:`RNGStatesTracker.fork`,
which swaps in a separate generator state seeded with ``seed + 2718 + tp_rank`` (Megatron's offset).

Works on CPU and CUDA: the tracker swaps the state of the default generator of the device in use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

MODEL_PARALLEL_RNG = "model-parallel-rng"
TP_SEED_OFFSET = 2718
PP_SEED_STRIDE = 100


def _get_state(device: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


def _set_state(device: str, state: torch.Tensor) -> None:
    if device == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that can be swapped in around a region of code."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        """Create state ``name`` seeded with ``seed`` without disturbing the current state."""
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = _get_state(self.device)
        if self.device == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device)
        _set_state(self.device, saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the body with generator state ``name``; its advanced state is kept for next time."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added (call model_parallel_seed)")
        saved = _get_state(self.device)
        _set_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(self.device, saved)


def model_parallel_seed(tracker: RNGStatesTracker, seed: int, *, tp_rank: int, pp_rank: int) -> None:
    """Seed the default generator (same on all TP ranks) and the TP-region generator (per TP rank)."""
    default_seed = seed + PP_SEED_STRIDE * pp_rank
    torch.manual_seed(default_seed)
    if tracker.device == "cuda":
        torch.cuda.manual_seed(default_seed)
    tracker.states.clear()
    tracker.add(MODEL_PARALLEL_RNG, default_seed + TP_SEED_OFFSET + tp_rank)


def checkpointed(fn: Callable[..., Any], tracker: RNGStatesTracker, *args: Any) -> Any:
    """Activation checkpointing that also replays the tracker's generator states.

    ``torch.utils.checkpoint`` already restores the default CPU/CUDA generator before the
    recomputation; the extra context restores the tracker's states too, so dropout inside TP
    regions draws the same masks in the recomputed forward as in the original one.
    """
    snapshot: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def on_forward() -> Iterator[None]:
        snapshot.update(tracker.get_states())
        yield

    @contextlib.contextmanager
    def on_recompute() -> Iterator[None]:
        current = tracker.get_states()
        tracker.set_states(snapshot)
        try:
            yield
        finally:
            tracker.set_states(current)

    return checkpoint(fn, *args, use_reentrant=False, context_fn=lambda: (on_forward(), on_recompute()))
