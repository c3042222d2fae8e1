"""dcp's ``FileSystemWriter`` writing one chunk at a time, with CRC-32s by ISA-L.

A ``.distcp`` file is one ``torch.save`` zip archive per stored chunk, back to back; the save's
``Metadata`` says where each lies (``storage_data``: file, offset, length). :class:`DistcpWriter`
writes the same bytes as ``FileSystemWriter(path, thread_count=N)`` (the default ``TORCH_SAVE``
format, N files per rank, fsynced; N = :func:`file_count`, 2 as megatron-core writes them where
there are two cores), with these differences in how:

* **Memory.** torch's file loop keeps every chunk it wrote in a dict (only its ``SAFETENSORS``
  format uses it) until the file is finished, so each key's last chunk stays alive: the
  embedding, and the last layer's chunks, beside the tensor being written. Here a chunk is
  dropped as soon as its archive is written: memory is one chunk per file being written.
* **CRC-32.** Torch's zip writer computes CRC-32s at a fraction of the write speed
  (:mod:`pretrain.checkpoint.zip_crc`), so each archive is written with
  ``torch.serialization.set_crc32_options(False)`` and its CRCs are filled in by ISA-L from the
  bytes just written (in the page cache).
* **Chunks from where they lie.** A planner that gives a chunk as a :class:`LazyTensor` of the
  source's stored blocks (:class:`ChunkPieces`: a legacy checkpoint's TP shards, a Hugging Face
  file's q/k/v rows) has it written by :func:`~pretrain.checkpoint.legacy.stream_save.stream_save`:
  the blocks gathered into the archive's record, its CRC-32 from them; no joined copy, no read-back.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
import torch.serialization as ser
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat, _StorageInfo, _write_item
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from pretrain.checkpoint.legacy.stream_save import LazyTensor, stream_save, writers
from pretrain.checkpoint.zip_crc import fill_crc32

_ZIP_START = b"PK\x03\x04"


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


def _minimal(data: torch.Tensor) -> torch.Tensor:
    """What torch's serial loader saves for ``data``: detached, and cloned when it is a view into
    a larger storage (``torch.save`` writes a tensor's whole storage)."""
    data = data.detach()
    return data.clone() if data.untyped_storage().size() != data.nbytes else data


@runtime_checkable
class ChunkPieces(Protocol):
    """A save planner that can give a tensor chunk as the source's stored blocks:
    ``resolve_pieces(item)`` is None where it cannot (the chunk is then ``resolve_data``'s)."""

    def resolve_pieces(self, write_item: WriteItem) -> LazyTensor | None: ...


class DistcpWriter(FileSystemWriter):
    """``FileSystemWriter(path, thread_count=N)`` (N: :func:`file_count`, megatron-core's 2 where
    there are two cores) with file loops that keep no chunk after writing it and fill CRC-32s by
    ISA-L. Local work only (no collectives); each process writes its own ``__<rank>_<i>.distcp``,
    in lockstep: chunk ``k`` of each file made in the calling thread, then written on one thread
    per file (the kernel's copy into the page cache, most of the time, then runs on every core;
    one file's writes are serialised by its inode lock)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=file_count())

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue) -> Future[list[WriteResult]]:
        """The files in lockstep: chunk ``k`` of every file is made here (one at a time, in this
        thread: the sources and a Ctrl-C see one caller), then written, each file on its own
        thread; byte items first, then tensor chunks, in plan order (as torch writes them)."""
        files: list[tuple[Path, str, list[WriteItem]]] = []
        while not file_queue.empty():
            path, storage_key, items = file_queue.get_nowait()
            ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
            files.append(
                (Path(path), storage_key, ordered + [i for i in items if i.type != WriteItemType.BYTE_IO])
            )
        results: list[list[WriteResult]] = [[] for _ in files]
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch_crc32_off())  # (process-wide: set once around every file)
            streams = [stack.enter_context(open(path, "w+b")) for path, _, _ in files]
            write_all = stack.enter_context(writers(len(files)))
            for k in range(max((len(items) for _, _, items in files), default=0)):
                writes = [
                    self._chunk_writer(planner, stream, items[k], key, results[n])
                    for n, ((_, key, items), stream) in enumerate(zip(files, streams, strict=True))
                    if k < len(items)
                ]
                write_all(writes)
                del writes  # the chunks go before the next are made
            for stream in streams:
                stream.flush()
                os.fsync(stream.fileno())
        done: Future[list[WriteResult]] = Future()
        done.set_result([r for file_results in results for r in file_results])
        return done

    def _chunk_writer(
        self, planner: SavePlanner, stream: io.BufferedRandom, item: WriteItem, storage_key: str,
        results: list[WriteResult],
    ) -> Callable[[], None]:  # fmt: skip
        """Make ``item``'s data now; the call returned appends it to ``stream`` (any thread)."""
        pieces = planner if isinstance(planner, ChunkPieces) and not self.transforms.extensions else None
        lazy = (
            pieces.resolve_pieces(item) if pieces is not None and item.type != WriteItemType.BYTE_IO else None
        )
        if lazy is not None:
            return lambda: results.append(_write_pieces(stream, lazy, item, storage_key))
        data = planner.resolve_data(item)
        if isinstance(data, torch.Tensor):
            data = _minimal(data)

        def write() -> None:
            stream.seek(0, os.SEEK_END)
            result = _write_item(self.transforms, stream, data, item, storage_key,
                                 SerializationFormat.TORCH_SAVE)  # fmt: skip
            start = result.storage_data.offset
            stream.flush()
            if os.pread(stream.fileno(), 4, start) == _ZIP_START:  # (a raw byte item stays as it is)
                fill_crc32(stream, start=start, end=start + result.storage_data.length)
            stream.seek(0, os.SEEK_END)
            results.append(result)

        return write


def _write_pieces(
    stream: io.BufferedRandom, lazy: LazyTensor, item: WriteItem, storage_key: str
) -> WriteResult:
    """One chunk's archive at the end of ``stream`` from its pieces (``torch.save``'s bytes, CRCs
    filled in), described as ``_write_item`` describes it (no stream transforms)."""
    stream.seek(0, os.SEEK_END)
    start = stream.tell()
    stream_save(lazy, stream)
    stream.seek(0, os.SEEK_END)
    length = stream.tell() - start
    return WriteResult(
        index=item.index, size_in_bytes=length, storage_data=_StorageInfo(storage_key, start, length)
    )
