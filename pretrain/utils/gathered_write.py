"""Writing byte chunks that lie apart in memory as one run of a file, without joining them first.

A file writer that has a tensor as pieces (a tensor-parallel shard's rows, the rows of a column
range of a mapped checkpoint block) hands the kernel the list: ``os.writev`` / ``os.pwritev`` take
up to ``IOV_MAX`` buffers a call, so a thousand gathered rows cost one system call and no copy in
this process. Short writes (a signal, a call over 2 GiB) are completed in order.

Rows of a few KB each (a row-parallel tensor's TP blocks joined along the columns: each row of the
output is a short row of each block) are the exception: the kernel's copy slows down per buffer,
and 2 KB rows went 3x slower than one buffer of the same bytes (0.43 s against 0.12-0.14 s for
512 MB here). :func:`column_chunks` joins such rows a few MB at a time into one reused staging
buffer (a copy in this process that stays in the caches; one per thread, kept) and hands out
that buffer's bytes.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterable, Iterator, Sequence

import torch

from pretrain.utils.mapped_source import disable_copy, source_of

__all__ = ["column_chunks", "flat_bytes", "interleaved_rows", "row_bytes", "write_gathered"]

_STAGE_BYTES = 8 << 20  # the staging buffer of column_chunks
_STAGE_BELOW = 64 << 10  # rows shorter than this (bytes) are staged; longer ones written where they lie
# Each thread keeps its staging buffer: a fresh one (8 MB: the allocator's huge pages) is zeroed by
# the kernel on first touch, twice per layer (two row-parallel tensors) in each writer and digest
# thread, 3% of a 1B legacy -> torch_dist conversion's CPU (clear_page_erms).
_stages = threading.local()

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16


def flat_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes (a 1-D byte view of its memory, no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def row_bytes(t: torch.Tensor) -> list[memoryview]:
    """A 2-D CPU tensor whose rows are each contiguous (``stride(1) == 1``; a column range of a
    larger block, or a contiguous tensor) as one byte view per row, in order (no copy)."""
    assert t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1), "rows must be contiguous"
    if t.numel() == 0:
        return []
    width = t.shape[1] * t.element_size()
    step = t.stride(0) * t.element_size()
    start = t.storage_offset() * t.element_size()
    span = t.untyped_storage()[start : start + step * (t.shape[0] - 1) + width]
    whole = torch.empty(0, dtype=torch.uint8).set_(span).numpy().data  # type: ignore[call-overload]
    return [whole[r * step : r * step + width] for r in range(t.shape[0])]


def interleaved_rows(parts: Sequence[torch.Tensor]) -> list[memoryview]:
    """The bytes of 2-D CPU ``parts`` (each ``[R, c_i]``, rows contiguous) joined along dim 1, in
    row-major order, where they lie: row ``r`` of each part in turn (``R x len(parts)`` views)."""
    per_part = [row_bytes(p) for p in parts]
    return [chunk for row in zip(*per_part, strict=True) for chunk in row]


def column_chunks(parts: Sequence[torch.Tensor]) -> list[memoryview] | Iterator[memoryview]:
    """The bytes of 2-D CPU ``parts`` (each ``[R, c_i]``, rows contiguous) joined along dim 1, in
    row-major order: each row of each part where it lies (:func:`interleaved_rows`) when the
    rows are long; else the joined rows a few MB at a time in one reused staging buffer, each view
    valid only until the next is taken (write or hash it first: :func:`write_gathered` does)."""
    rows, width = parts[0].shape[0], sum(p.shape[1] for p in parts)
    if rows == 0 or width == 0:
        return []
    if all(p.shape[1] * p.element_size() >= _STAGE_BELOW for p in parts):
        return interleaved_rows(parts)
    return _staged(parts, rows, width, step=max(1, _STAGE_BYTES // (width * parts[0].element_size())))


def _staged(parts: Sequence[torch.Tensor], rows: int, width: int, *, step: int) -> Iterator[memoryview]:
    shape = (min(step, rows), width)
    held = getattr(_stages, "free", None)  # this thread's buffer, unless a staging in it is under way
    _stages.free = None
    nbytes = shape[0] * width * parts[0].element_size()
    if held is None or held.numel() < nbytes:
        held = torch.empty(max(nbytes, _STAGE_BYTES), dtype=torch.uint8)
    try:
        stage = held[:nbytes].view(parts[0].dtype).view(shape)
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            block = stage[: hi - lo]
            torch.cat([p[lo:hi] for p in parts], dim=1, out=block)
            yield flat_bytes(block)
    finally:
        _stages.free = held


def write_gathered(fd: int, chunks: Iterable[memoryview], offset: int | None = None) -> None:
    """Write the 1-D byte ``chunks`` in order to ``fd``: at its position (``offset`` None) or from
    byte ``offset`` on (the file position unchanged). A sequence goes ``IOV_MAX`` buffers a call;
    any other iterable (e.g. :func:`column_chunks`' staged views) one chunk at a time, each written
    before the next is taken. A chunk whose bytes lie in a mapped file, unchanged, is copied by the
    kernel from that file (:func:`~pretrain.utils.mapped_source.source_of`)."""
    if not isinstance(chunks, Sequence):
        at = offset if offset is not None else 0
        for chunk in chunks:
            write_gathered(fd, [chunk], None if offset is None else at)
            at += len(chunk)
        return
    at = offset if offset is not None else 0
    plain: list[memoryview] = []  # the chunks written from memory, since the last one copied
    for chunk in chunks:
        source = source_of(chunk)
        if source is None:
            plain.append(chunk)
            continue
        at = _write_plain(fd, plain, offset, at)
        plain = []
        at = _copy_from(fd, source, chunk, offset, at)
    _write_plain(fd, plain, offset, at)


def _write_plain(fd: int, chunks: Sequence[memoryview], offset: int | None, at: int) -> int:
    """Write ``chunks`` from memory (``at``: where, when ``offset`` is given); the byte after them."""
    if not hasattr(os, "pwritev"):  # (not on Windows): one chunk a call
        for chunk in chunks:
            at = _write_from(fd, chunk, offset, at)
        return at
    for lo in range(0, len(chunks), _IOV_MAX):
        batch = chunks[lo : lo + _IOV_MAX]
        want = sum(map(len, batch))
        done = os.writev(fd, batch) if offset is None else os.pwritev(fd, batch, at)
        if done < want:  # a short write: the rest of the batch, chunk by chunk
            skip = done
            for chunk in batch:
                if skip >= len(chunk):
                    skip -= len(chunk)
                    continue
                _write_from(fd, chunk[skip:], offset, at + done)
                done += len(chunk) - skip
                skip = 0
        at += want
    return at


def _copy_from(fd: int, source: tuple[int, int], chunk: memoryview, offset: int | None, at: int) -> int:
    """Copy ``chunk``'s bytes from their file (``source``: descriptor, offset) in the kernel; what a
    refusing kernel or file system leaves is written from memory (and copying is off from then on).
    The byte after them."""
    src, src_at = source
    done = 0
    try:
        while done < len(chunk):
            n = os.copy_file_range(
                src, fd, len(chunk) - done, src_at + done, None if offset is None else at + done
            )
            if n == 0:  # (the source file shrank): the rest from memory
                break
            done += n
    except OSError as e:
        if e.errno not in _NO_COPY:
            raise
        disable_copy()
    if done < len(chunk):
        _write_from(fd, chunk[done:], offset, at + done)
    return at + len(chunk)


_NO_COPY = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM})


def _write_from(fd: int, view: memoryview, offset: int | None, at: int) -> int:
    """Write all of ``view`` (at ``at`` when ``offset`` is given); the position after it."""
    while len(view):
        n = os.write(fd, view) if offset is None else os.pwrite(fd, view, at)
        view, at = view[n:], at + n
    return at
