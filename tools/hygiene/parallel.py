"""An ordered parallel map with a bounded number of chunks in flight (so input is streamed)."""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(
    fn: Callable[[T], R], chunks: Iterable[T], *, workers: int, max_pending: int | None = None
) -> Iterator[tuple[T, R]]:
    """Yield ``(chunk, fn(chunk))`` in input order, computing ``fn`` in ``workers`` processes.

    ``Pool.imap`` would read the whole input into its task queue; here at most ``max_pending``
    chunks (default ``2 * workers``) are read ahead, so memory stays bounded on any corpus size.
    ``fn`` must be picklable (a module-level function or a ``functools.partial`` of one).
    """
    if workers <= 1:
        for chunk in chunks:
            yield chunk, fn(chunk)
        return
    limit = max_pending or 2 * workers
    with multiprocessing.get_context().Pool(workers) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append((chunk, pool.apply_async(fn, (chunk,))))
            if len(pending) >= limit:
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()


def batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Group an iterable into lists of ``size`` items (the last one may be shorter)."""
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
