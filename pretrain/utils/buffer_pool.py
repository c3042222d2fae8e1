"""Reuse of large CPU buffers between tensors of the same size.

A conversion makes every full tensor once (joining its TP shards) and drops it once written.
Each fresh allocation of that size comes from the kernel as new pages, which the kernel zeroes
before torch copies over them: a quarter of a 3B conversion's CPU time went to that zeroing
(``clear_page_erms`` in ``perf``). Layers repeat the same shapes, so a buffer freed by one layer
fits the next layer's tensor of the same size.

:class:`BufferPool` holds the buffers it made; one is free again when nothing but the pool refers
to its storage (``torch._C._storage_Use_Count`` is 1: no tensor or view of it is alive), so a
buffer still used by a consumer is never handed out. The buffers it holds never exceed its
``budget`` in bytes, so the memory it adds is bounded: beyond it, allocations are not held.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = [
    "BufferPool",
    "pooled_buffers",
    "pooled_cat",
    "pooled_copy",
    "pooled_empty",
    "pooling",
    "read_only_views",
]


def _is_free(storage: torch.UntypedStorage) -> bool:
    return torch._C._storage_Use_Count(storage._cdata) == 1  # only the pool's own reference


class BufferPool:
    """``empty(shape, dtype)`` that reuses a held, free buffer of exactly that many bytes.

    ``budget``: the most bytes of buffers held (free or in use); ``None``: 2 x the largest
    request so far, the tensor term of a conversion's memory bound (2 x the largest tensor +
    0.5 GB). That holds a Llama-shaped layer's four sizes (QKV, projection, both MLP matrices)
    even before any larger tensor was seen: with GQA and ``ffn >= 8/3 hidden`` they sum to at
    most 2 x the fused fc1. At 1.5 x, to-hf at 3B dropped and re-made fc1 and fc2 in every layer
    (114 joins, 61 fresh). When a new size does not fit, the largest free buffers are dropped
    first (a layer's sizes then stay, the embedding's goes). Requests under ``min_bytes`` are
    plain allocations (small ones come from the allocator's own caches).
    Not thread-safe: one pool per thread that allocates.
    """

    def __init__(self, budget: int | None = None, *, min_bytes: int = 1 << 20) -> None:
        self.budget, self.min_bytes = budget, min_bytes
        self._largest = 0
        self._held: list[torch.UntypedStorage] = []
        self.reused = self.fresh = 0  # counts, for tests and logs

    @property
    def held_bytes(self) -> int:
        return sum(s.nbytes() for s in self._held)

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes:
            return torch.empty(shape, dtype=dtype)
        self._largest = max(self._largest, nbytes)
        storage = next((s for s in self._held if s.nbytes() == nbytes and _is_free(s)), None)
        if storage is None:
            storage = self._fresh(nbytes)
        else:
            self.reused += 1
        return torch.empty(0, dtype=dtype).set_(storage).view(tuple(shape))

    def _fresh(self, nbytes: int) -> torch.UntypedStorage:
        self.fresh += 1
        storage = torch.UntypedStorage(nbytes)
        budget = self.budget if self.budget is not None else 2 * self._largest
        free = sorted((s for s in self._held if _is_free(s)), key=lambda s: s.nbytes(), reverse=True)
        while free and self.held_bytes + nbytes > budget:  # make room: the largest free buffers go
            dropped = free.pop(0)
            self._held = [s for s in self._held if s is not dropped]
        if self.held_bytes + nbytes <= budget:
            self._held.append(storage)
        return storage

    def clear(self) -> None:
        """Drop every held buffer (those in use live on with their tensors)."""
        self._held = []


_ACTIVE: contextvars.ContextVar[BufferPool | None] = contextvars.ContextVar("buffer_pool", default=None)
_READ_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("read_only_views", default=False)


@contextlib.contextmanager
def pooled_buffers(pool: BufferPool | None = None) -> Iterator[BufferPool]:
    """Within the block, :func:`pooled_empty` allocates from ``pool`` (default a new one): a
    conversion sets it around its write loop, so the tensors its mapping tables build (which do
    not know about pools) reuse freed buffers."""
    pool = pool if pool is not None else BufferPool()
    token = _ACTIVE.set(pool)
    try:
        yield pool
    finally:
        _ACTIVE.reset(token)


def pooling() -> bool:
    """A :func:`pooled_buffers` pool is active in this thread and no dispatch mode is (a shape dry
    run, :mod:`pretrain.utils.shape_probe`, makes no memory; an ``out=`` op under it would
    import ``torch._dynamo``). Callers take their plain path otherwise."""
    return _ACTIVE.get() is not None and _get_current_dispatch_mode() is None


def pooled_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)``, from the active pool when :func:`pooling`."""
    pool = _ACTIVE.get()
    return (
        pool.empty(shape, dtype) if pool is not None and pooling() else torch.empty(tuple(shape), dtype=dtype)
    )


def pooled_cat(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat(tensors, dim)`` (contiguous), into a pooled buffer when :func:`pooling` and the
    inputs are CPU tensors needing no gradients (``out=`` ops do not record autograd)."""
    if not pooling() or tensors[0].device.type != "cpu" or any(t.requires_grad for t in tensors):
        return torch.cat(tensors, dim=dim).contiguous()
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return torch.cat(tensors, dim=dim, out=pooled_empty(tuple(shape), tensors[0].dtype))


@contextlib.contextmanager
def read_only_views() -> Iterator[None]:
    """Within the block (this thread), :func:`pooled_copy` gives a contiguous CPU tensor back
    as it is: for a consumer that only reads each tensor while its source stays open. The weights
    fingerprint hashes a source's bytes where they lie; before, from-hf's background fingerprint
    copied every Hugging Face tensor into fresh pages first (the kernel zeroing them was 15% of
    from-hf's CPU samples at 3B)."""
    token = _READ_ONLY.set(True)
    try:
        yield
    finally:
        _READ_ONLY.reset(token)


def pooled_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in memory of its own (pooled when :func:`pooling`); ``t``
    itself when contiguous on the CPU within :func:`read_only_views`."""
    if _READ_ONLY.get() and t.device.type == "cpu" and t.is_contiguous():
        return t
    if not pooling() or t.device.type != "cpu" or t.requires_grad:
        return t.clone(memory_format=torch.contiguous_format)  # one copy, contiguous
    return pooled_empty(t.shape, t.dtype).copy_(t)
