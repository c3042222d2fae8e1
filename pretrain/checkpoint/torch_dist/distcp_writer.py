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

import io
import os
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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

from pretrain.checkpoint.legacy.stream_save import LazyTensor, stream_save
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
    each file on its own thread (the kernel's copy into the page cache, most of the time, then runs
    on every core; one file's writes are serialised by its inode lock). The chunks are made one at
    a time (one lock: the sources are read from one thread at a time)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=file_count())
        self._making = threading.Lock()

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue) -> Future[list[WriteResult]]:
        files = []
        while not file_queue.empty():
            path, storage_key, items = file_queue.get_nowait()
            files.append((Path(path), storage_key, items))
        with torch_crc32_off():  # (process-wide: set once around every file's thread)
            if len(files) < 2:
                results = [r for f in files for r in self._write_file(*f, planner)]
            else:
                with ThreadPoolExecutor(max_workers=len(files), thread_name_prefix="distcp") as pool:
                    futures = [pool.submit(self._write_file, *f, planner) for f in files]
                    results = [r for future in futures for r in future.result()]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _write_file(
        self, path: Path, storage_key: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        """Byte items first, then tensor chunks, in plan order (as torch writes them)."""
        ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
        ordered += [i for i in items if i.type != WriteItemType.BYTE_IO]
        results = []
        pieces = planner if isinstance(planner, ChunkPieces) and not self.transforms.extensions else None
        with open(path, "w+b") as stream:
            for item in ordered:
                with self._making:  # (the pieces are views: made here, written outside the lock)
                    lazy = (
                        pieces.resolve_pieces(item)
                        if pieces is not None and item.type != WriteItemType.BYTE_IO
                        else None
                    )
                if lazy is not None:
                    results.append(_write_pieces(stream, lazy, item, storage_key))
                    continue
                with self._making:
                    data = planner.resolve_data(item)
                    if isinstance(data, torch.Tensor):
                        data = _minimal(data)
                result = _write_item(self.transforms, stream, data, item, storage_key,
                                     SerializationFormat.TORCH_SAVE)  # fmt: skip
                del data  # the chunk goes before the next is made
                start = result.storage_data.offset
                stream.flush()
                if os.pread(stream.fileno(), 4, start) == _ZIP_START:  # (a raw byte item stays as it is)
                    fill_crc32(stream, start=start, end=start + result.storage_data.length)
                stream.seek(0, os.SEEK_END)
                results.append(result)
            stream.flush()
            os.fsync(stream.fileno())
        return results


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
