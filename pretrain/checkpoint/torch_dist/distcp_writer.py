"""The ``.distcp`` files of one process of a ``torch_dist`` save, written without dcp.

A ``.distcp`` file is one ``torch.save`` zip archive per stored item, back to back; the save's
``.metadata`` (:mod:`~pretrain.checkpoint.torch_dist.dcp_meta_write`) says where each lies (file,
offset, length). :func:`write_distcp_files` writes the bytes dcp's
``FileSystemWriter(path, thread_count=N)`` writes (the default ``TORCH_SAVE`` format, N files per
rank, fsynced; N = :func:`file_count`, 2 as megatron-core writes them where there are two cores):
the same assignment of items to files (:func:`file_bins`, dcp's ``_split_by_size_and_type``), byte
entries first in each file, then the tensor chunks. ``tests/test_dcp_meta_write.py`` proves the
files byte for byte against dcp's own save. Unlike dcp's writer:

* **No dcp import.** ``torch.distributed.checkpoint`` costs 0.9-1.2 s to import on a 2-core host.
* **Memory.** torch's file loop keeps every chunk it wrote in a dict (only its ``SAFETENSORS``
  format uses it) until the file is finished, so each key's last chunk stays alive. Here a chunk is
  dropped as soon as its archive is written: memory is at most the largest batch of chunks (one
  per file) that writing one batch at a time holds.
* **CRC-32.** Torch's zip writer computes CRC-32s at a fraction of the write speed
  (:mod:`pretrain.checkpoint.zip_crc`), so each archive is written with
  ``torch.serialization.set_crc32_options(False)`` and its CRCs are filled in by ISA-L from the
  bytes just written (in the page cache).
* **Chunks from where they lie.** A chunk given as a :class:`LazyTensor` of the source's stored
  blocks (a legacy checkpoint's TP shards, a Hugging Face file's q/k/v rows) is written by
  :func:`~pretrain.checkpoint.legacy.stream_save.stream_save`: the blocks gathered into the
  archive's record, its CRC-32 from them; no joined copy, no read-back.
* **Order.** The results come file by file in write order (dcp's come in the order its threads
  finish), so the ``.metadata`` is the same from run to run.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch
import torch.serialization as ser

from pretrain.checkpoint.legacy.stream_save import LazyTensor, stream_save, writers
from pretrain.checkpoint.torch_dist.dcp_meta_write import PlannedItem, StoredItem
from pretrain.checkpoint.zip_crc import fill_crc32

_ZIP_START = b"PK\x03\x04"
ItemData = torch.Tensor | bytes | LazyTensor  # a chunk, a byte entry, or a chunk's stored blocks


ItemT = TypeVar("ItemT", bound=PlannedItem)


def file_count() -> int:
    """``.distcp`` files per process: 2 (megatron-core's default ``thread_count``) where there
    are two cores or more, else 1."""
    return 2 if (os.cpu_count() or 1) >= 2 else 1


@contextmanager
def torch_crc32_off() -> Iterator[None]:
    """``torch.save`` writes CRC-32 fields as 0 inside this block (process-wide setting)."""
    previous = ser.get_crc32_options()
    ser.set_crc32_options(False)
    try:
        yield
    finally:
        ser.set_crc32_options(previous)


def file_bins(items: Sequence[ItemT], bins: int) -> list[list[ItemT]]:
    """dcp's ``_split_by_size_and_type``: one bin is the items as planned; more: byte entries dealt
    round robin, then the tensor chunks, largest first (a stable sort; by the bytes of their
    *global* tensor, as dcp's ``_item_size`` measures them), each to the
    first bin with the fewest bytes so far. (In each file the byte entries are written first.)"""
    if bins == 1:
        return [list(items)]
    buckets: list[list[ItemT]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    for n, item in enumerate(i for i in items if i.chunk is None):
        buckets[n % bins].append(item)
    for item in sorted((i for i in items if i.chunk is not None), key=_global_bytes, reverse=True):
        smallest = min(range(bins), key=sizes.__getitem__)
        buckets[smallest].append(item)
        sizes[smallest] += _global_bytes(item)
    return buckets


def write_distcp_files(
    it_dir: Path, rank: int, items: Sequence[ItemT], make: Callable[[ItemT], ItemData]
) -> list[StoredItem]:
    """Write ``items`` (this rank's plan, in plan order) into ``it_dir/__<rank>_<n>.distcp`` and
    say where each went (file by file, in write order). Local work only: no collectives.

    The files are written in lockstep: item ``k`` of each file is made here (``make``, one at a
    time, in the calling thread: the sources and a Ctrl-C see one caller), then written on one
    thread per file (the kernel's copy into the page cache then runs on every core; one file's
    writes are serialised by its inode lock), and dropped once written; item ``k + 1`` is made
    while they are written where the bytes of both fit in the largest batch's
    (:class:`~pretrain.checkpoint.legacy.stream_save.WritePipeline`): memory stays what writing one
    batch at a time holds."""
    files = [
        (
            f"__{rank}_{n}.distcp",
            [i for i in bucket if i.chunk is None] + [i for i in bucket if i.chunk is not None],
        )
        for n, bucket in enumerate(file_bins(items, file_count()))
    ]
    results: list[list[StoredItem]] = [[] for _ in files]
    count = max((len(bucket) for _, bucket in files), default=0)
    batch_bytes = [sum(_item_bytes(b[k]) for _, b in files if k < len(b)) for k in range(count)]
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch_crc32_off())  # (process-wide: set once around every file)
        streams = [stack.enter_context(open(it_dir / name, "w+b")) for name, _ in files]
        with writers(len(files), cap=max(batch_bytes, default=0)) as pipeline:
            for k in range(count):

                def batch(k: int = k) -> list[Callable[[], None]]:
                    return [
                        _item_writer(stream, bucket[k], make(bucket[k]), name, results[n])
                        for n, ((name, bucket), stream) in enumerate(zip(files, streams, strict=True))
                        if k < len(bucket)
                    ]

                pipeline.run(batch, batch_bytes[k])
        for stream in streams:
            stream.flush()
            os.fsync(stream.fileno())
    return [r for file_results in results for r in file_results]


def _item_bytes(item: PlannedItem) -> int:
    """The bytes an item's data holds (a byte entry's: about none)."""
    return 0 if item.chunk is None else math.prod(item.chunk.sizes) * item.chunk.dtype.itemsize


def _global_bytes(item: PlannedItem) -> int:
    """The bytes of the item's whole global tensor (what dcp bins a chunk by)."""
    return 0 if item.chunk is None else math.prod(item.chunk.size) * item.chunk.dtype.itemsize


def _minimal(data: torch.Tensor) -> torch.Tensor:
    """What torch's serial loader saves for ``data``: detached, and cloned when it is a view into
    a larger storage (``torch.save`` writes a tensor's whole storage)."""
    data = data.detach()
    return data.clone() if data.untyped_storage().size() != data.nbytes else data


def _item_writer(
    stream: io.BufferedRandom,
    item: PlannedItem,
    data: ItemData,
    relative_path: str,
    results: list[StoredItem],
) -> Callable[[], None]:
    """The call that appends ``item``'s archive (or raw bytes) to ``stream`` and its place to
    ``results`` (any thread)."""
    if isinstance(data, torch.Tensor):
        data = _minimal(data)

    def write() -> None:
        stream.seek(0, os.SEEK_END)
        start = stream.tell()
        if isinstance(data, LazyTensor):  # its stored blocks gathered into the record, CRCs from them
            stream_save(data, stream)
        elif isinstance(data, torch.Tensor):
            torch.save(data, stream)
        else:
            stream.write(data)
        stream.flush()
        end = stream.seek(0, os.SEEK_END)
        if not isinstance(data, LazyTensor) and os.pread(stream.fileno(), 4, start) == _ZIP_START:
            fill_crc32(stream, start=start, end=end)  # (raw bytes that are no archive stay as they are)
            stream.seek(0, os.SEEK_END)
        results.append(StoredItem(item.key, item.chunk, relative_path, start, end - start))

    return write
