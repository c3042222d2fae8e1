"""Bytes kept for backward, counted (not estimated) with ``torch.autograd.graph.saved_tensors_hooks``.

Every tensor autograd saves during the counted region is recorded by its storage, so a storage
saved by several ops (a layer's input kept by its norm and by the residual add) counts once, and
the whole storage counts even when a view was saved (that is what stays allocated). Storages of
the model's parameters are excluded: they are not activations.

Activation checkpointing keeps its region's *inputs* alive by reference, not through autograd's
saved tensors, and saves nothing inside the region (its own hooks replace ours there). So the
counter also records the tensor arguments of every :func:`pretrain.parallel.rng.checkpointed`
region entered while counting, which is what a checkpoint really holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from pretrain.parallel import rng


class SavedBytes:
    """``with counter.counting(): out = model(x)`` then ``counter.total`` (bytes, deduplicated)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.excluded = {p.untyped_storage().data_ptr() for p in exclude}
        self.storages: dict[int, int] = {}  # storage data_ptr -> nbytes

    def record(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in self.excluded:
            self.storages[key] = max(self.storages.get(key, 0), storage.nbytes())

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.record(t)
        return t

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        real = rng.checkpoint

        def recording_checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            for a in args:
                self.record(a)
            return real(fn, *args, **kwargs)

        rng.checkpoint = recording_checkpoint  # type: ignore[assignment]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            rng.checkpoint = real
