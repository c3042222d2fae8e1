"""``torch.save`` files written one tensor at a time: a rank file never whole in memory.

``torch.save`` writes a zip archive: ``data.pkl`` (the pickled object, each tensor's storage
named by a persistent id ``("storage", <dtype>Storage, key, location, numel)``), a few small
records, then one record ``data/<key>`` per storage in the order the pickle met them. The pickle
needs only each tensor's dtype and shape, so :func:`stream_save` pickles an object whose model
tensors are :class:`LazyTensor` placeholders (dtype, shape, and a function making the data), then
makes each tensor just before its record is written and drops it at once: memory stays at one
tensor, whatever the file's size (files written in lockstep hold record ``k`` of each at once: a
pipeline stage's TP shards, views of one tensor). Real tensors in the object (optimizer state,
RNG state) are written as ``torch.save`` writes them.

The bytes are those ``torch.save`` writes for the same object with real tensors (the same
pickle, the records in the same order, through torch's own zip writer with its alignment
settings; ``tests/test_zip_crc.py``), so ``torch.load(weights_only=True)`` and megatron-core
read the files as before. Into a file opened for reading and writing (``w+b``), the CRC-32s are
not computed by torch's slow writer but by :mod:`~pretrain.checkpoint.zip_crc` (ISA-L) from each
record's bytes while they are in memory, and filled in when the archive is finished: the same
bytes, a third less time. Other targets (``wb`` files, ``BytesIO``) get torch's CRCs, as before.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import IO

import torch
import torch.serialization as ser

from pretrain.checkpoint.types import ColumnPieces, RowPieces
from pretrain.checkpoint.zip_crc import crc32, fill_crc32
from pretrain.utils.buffer_pool import pooled_copy
from pretrain.utils.gathered_write import column_chunks, flat_bytes, write_gathered
from pretrain.utils.writeback import MIN_BYTES, start_writeback

Made = torch.Tensor | RowPieces | ColumnPieces  # (pieces: written where they lie, not joined)


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """A contiguous tensor of ``dtype`` and ``shape`` that ``make()`` produces when it is written
    (of ``shape``, or of ``shape`` without leading size-1 axes: a chunk of a stacked tensor)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], Made]

    def __reduce_ex__(self, protocol: object) -> tuple[object, ...]:
        """What a contiguous CPU tensor reduces to (``torch.Tensor._reduce_ex_internal``)."""
        if self.dtype in torch.storage._new_dtypes():  # the v3 rebuild path: a real tensor, made now
            return _joined(self.make()).reshape(self.shape).__reduce_ex__(protocol)  # type: ignore[arg-type]
        stride, step = [], 1
        for n in reversed(self.shape):
            stride.append(step)
            step *= n
        args: tuple[object, ...] = (_LazyStorage(self), 0, tuple(self.shape), tuple(reversed(stride)), False,
                collections.OrderedDict())  # fmt: skip
        return (torch._utils._rebuild_tensor_v2, args)


@dataclass(frozen=True, eq=False)
class _LazyStorage:
    tensor: LazyTensor


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


class _Pickler(pickle.Pickler):
    """``torch.save``'s persistent ids, for real storages and lazy ones alike."""

    def __init__(self, buf: IO[bytes]) -> None:
        super().__init__(buf, protocol=2)
        self.keys: dict[int, str] = {}  # storage identity -> record key
        self.records: list[torch.UntypedStorage | LazyTensor] = []

    def _key(self, ident: int, record: torch.UntypedStorage | LazyTensor) -> tuple[str, bool]:
        if ident in self.keys:
            return self.keys[ident], False
        key = self.keys[ident] = str(len(self.keys))
        self.records.append(record)
        return key, True

    def persistent_id(self, obj: object) -> tuple[object, ...] | None:
        if isinstance(obj, _LazyStorage):
            t = obj.tensor
            key, _ = self._key(id(t), t)
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[t.dtype])
            return ("storage", storage_type, key, "cpu", _numel(t.shape))
        if isinstance(obj, torch.storage.TypedStorage):
            storage = obj._untyped_storage
            key, _ = self._key(storage._cdata, storage)
            storage_type = getattr(torch, obj._pickle_storage_type())
            return ("storage", storage_type, key, ser.location_tag(storage), obj._size())
        if isinstance(obj, torch.UntypedStorage):
            key, _ = self._key(obj._cdata, obj)
            return ("storage", torch.UntypedStorage, key, ser.location_tag(obj), obj.nbytes())
        return None


def _joined(made: Made) -> torch.Tensor:
    if isinstance(made, RowPieces):
        return torch.cat(made.parts)
    return torch.cat(made.parts, dim=1) if isinstance(made, ColumnPieces) else made


def _tensor_writer(archive: _Archive, name: str, lazy: LazyTensor) -> Callable[[], None]:
    """Make ``lazy`` now; the call returned writes it as record ``name`` (from any thread)."""
    made = lazy.make()
    lead = len(lazy.shape) - len(made.shape)
    stacked = lead >= 0 and all(n == 1 for n in lazy.shape[:lead])  # (a chunk of a stacked tensor)
    if made.dtype != lazy.dtype or not stacked or tuple(lazy.shape[lead:]) != tuple(made.shape):
        raise RuntimeError(
            f"stream_save: {name} was announced as {lazy.dtype} {tuple(lazy.shape)}, "
            f"made as {made.dtype} {tuple(made.shape)}"
        )
    nbytes = _numel(tuple(made.shape)) * made.dtype.itemsize
    # (torch < 2.5 lacks the header-only record: the pieces are joined there, as before)
    gathers = archive.crcs is not None and hasattr(archive.zf, "write_record_metadata")
    chunks = _gathered(made) if gathers else None
    if chunks is not None:  # its pieces or rows where they lie, gathered into the record: no copy
        return lambda: archive.write_gathered(name, chunks, nbytes)
    t = _joined(made).detach().to("cpu")
    if not t.is_contiguous():  # a row-parallel shard: copied into a pooled buffer during a conversion
        t = pooled_copy(t)
    # its bytes where they lie: a view of a larger storage (a TP shard cut from the full tensor)
    # is written from a storage slice, which shares the memory (no copy first)
    start = t.storage_offset() * t.element_size()
    return lambda: archive.write(name, t.untyped_storage()[start : start + nbytes], nbytes,
                                 lambda: crc32(t.reshape(-1).view(torch.uint8).numpy()))  # fmt: skip


def _gathered(made: Made) -> list[memoryview] | Iterator[memoryview] | None:
    """The record's bytes as chunks where they lie: each piece of :class:`RowPieces`; for
    :class:`ColumnPieces` or a 2-D CPU view whose rows are contiguous (a column range of a block)
    their joined rows (:func:`~pretrain.utils.gathered_write.column_chunks`: where they lie, or
    staged a few MB at a time when short); a contiguous tensor's bytes as one chunk
    (:func:`~pretrain.utils.gathered_write.write_gathered` copies them from their file where they
    lie in a mapped one); ``None`` for anything else (written as before)."""
    parts = made.parts if isinstance(made, RowPieces | ColumnPieces) else (made,)
    if any(p.device.type != "cpu" for p in parts):
        return None
    if isinstance(made, ColumnPieces):
        rows_whole = all(p.dim() == 2 and (p.stride(1) == 1 or p.shape[1] <= 1) for p in parts)
        return column_chunks(parts) if rows_whole and made.shape.numel() else None
    if isinstance(made, RowPieces):
        return [flat_bytes(p) for p in parts if p.numel()] if all(p.is_contiguous() for p in parts) else None
    if made.numel() == 0:
        return None
    if made.is_contiguous():  # one run where it lies: a mapped file's bytes are copied file to file
        return [flat_bytes(made)]
    if made.dim() != 2 or made.stride(1) != 1:
        return None
    return column_chunks([made])


@dataclass
class _Archive:
    """One file being written: torch's zip writer, the storages still to write, and the CRC-32 of
    each record written so far when this module fills them in (None: torch computes them)."""

    zf: torch._C.PyTorchFileWriter
    records: list[torch.UntypedStorage | LazyTensor | None]
    crcs: dict[str, int] | None
    fh: IO[bytes]
    start: int = 0  # where the archive begins in the file (one of several back to back: a .distcp)

    def write(self, name: str, data: object, nbytes: int, crc_of: Callable[[], int]) -> None:
        if self.crcs is not None:
            self.crcs[name] = crc_of()
        start = self.fh.tell()
        self.zf.write_record(name, data, nbytes)  # type: ignore[arg-type]
        if self._writes_back(nbytes):
            self.fh.flush()
            start_writeback(self.fh.fileno(), start, self.fh.tell() - start)

    def write_gathered(self, name: str, chunks: list[memoryview] | Iterator[memoryview], nbytes: int) -> None:
        """Record ``name`` from ``chunks`` in order: torch writes its header and leaves room for
        the data (``write_record_metadata``, what ``torch.save`` does for skipped data), then the
        chunks go into that room (``pwritev``); its CRC-32 from the chunks (filled in at the end).
        An iterator's chunks may be transient (staged): each is hashed and written before the next."""
        assert self.crcs is not None
        self.fh.flush()
        header = self.fh.tell()  # the record's local header starts here
        self.zf.write_record_metadata(name, nbytes)  # type: ignore[attr-defined]
        self.fh.flush()
        fd = self.fh.fileno()
        # the data follows the 30-byte local header, its name and its extra field (torch's alignment
        # padding); a data descriptor may follow the data, so the end of the record is no guide
        fixed = os.pread(fd, 30, header)
        if len(fixed) != 30 or fixed[:4] != b"PK\x03\x04":
            raise RuntimeError(f"stream_save: no local header for {name} at byte {header}")
        name_len, extra_len = struct.unpack("<HH", fixed[26:30])
        data_at = at = header + 30 + name_len + extra_len
        crc = 0
        if isinstance(chunks, list):
            for chunk in chunks:
                crc = crc32(chunk, crc)
            write_gathered(fd, chunks, at)
        else:
            for chunk in chunks:
                crc = crc32(chunk, crc)
                write_gathered(fd, [chunk], at)
                at += len(chunk)
        self.crcs[name] = crc
        if self._writes_back(nbytes):
            start_writeback(fd, header, data_at + nbytes - header)

    def _writes_back(self, nbytes: int) -> bool:
        """Whether to queue the disk writeback of a record of ``nbytes`` just written: in a real
        file (``crcs`` is None for BytesIO and ``wb`` streams), which the archive's owner fsyncs
        once complete (``atomic_open``, the ``torch_dist`` writer), so that fsync finds most of it
        on disk already (:mod:`pretrain.utils.writeback`); records under a MB are left to it."""
        return self.crcs is not None and nbytes >= MIN_BYTES


def _fills_crc(fh: IO[bytes]) -> bool:
    """Whether :func:`fill_crc32` can finish ``fh``: a real file open for reading and writing."""
    try:
        fh.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return fh.readable() and fh.seekable()


def _begin(obj: object, fh: IO[bytes]) -> _Archive:
    """Write ``obj``'s pickle and the small records; the storages still to write, in order."""
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(obj)
    data = buf.getvalue()
    fill = _fills_crc(fh)
    start = fh.tell() if fill else 0
    zf = torch._C.PyTorchFileWriter(fh, not fill and ser.get_crc32_options(), ser._get_storage_alignment())
    archive = _Archive(zf, list(pickler.records), {} if fill else None, fh, start)
    archive.write("data.pkl", data, len(data), lambda: crc32(data))
    for record, value in ((".format_version", "1"), (".storage_alignment", str(ser._get_storage_alignment())),
                          ("byteorder", sys.byteorder)):  # fmt: skip
        raw = value.encode()
        archive.write(record, raw, len(raw), lambda raw=raw: crc32(raw))  # type: ignore[misc]
    return archive


def stream_save_all(files: Sequence[tuple[object, IO[bytes]]]) -> None:
    """``torch.save(obj, fh)`` for every pair, each :class:`LazyTensor` made only when written.

    The files are written in lockstep, record ``k`` of every file before record ``k + 1`` of any:
    files of the same layout (a pipeline stage's TP ranks) then ask for the same source tensor one
    after another, which a one-tensor cache in the caller turns into one read. Record ``k`` of
    each file is made in this thread, then the files' records are written by up to one thread per
    CPU (the kernel's copy into the page cache, most of a conversion's time, runs on every core;
    each file has its own writer, and the files' bytes are those of one thread), while record
    ``k + 1`` is made where the two fit in the largest record batch's bytes (:class:`WritePipeline`)."""
    started: list[_Archive] = []
    try:
        for obj, fh in files:
            started.append(_begin(obj, fh))
        count = max((len(a.records) for a in started), default=0)
        batch_bytes = [
            sum(_record_bytes(a.records[k]) for a in started if k < len(a.records)) for k in range(count)
        ]
        with writers(len(started), cap=max(batch_bytes, default=0)) as pipeline:
            for key in range(count):

                def make(key: int = key) -> list[Callable[[], None]]:
                    writes = []
                    for archive in started:
                        if key < len(archive.records):
                            record = archive.records[key]
                            archive.records[key] = None  # dropped once written
                            assert record is not None
                            writes.append(_record_writer(archive, f"data/{key}", record))
                    return writes

                pipeline.run(make, batch_bytes[key])
    finally:
        # finish every archive while its file is open (also on an error or Ctrl-C: a writer left to
        # the garbage collector would finish it into a closed file and abort the process)
        for archive in started:
            archive.zf.write_end_of_file()
    for archive, (_, fh) in zip(started, files, strict=True):
        if archive.crcs is not None:  # torch's own closing records (version, id) are read back
            fill_crc32(fh, archive.crcs, start=archive.start)
    for _, fh in files:
        fh.flush()


class WritePipeline:
    """Batches of writes (one per file: record ``k`` of each), each batch made in the calling
    thread and written on up to one thread per CPU; the next batch is made while the previous one
    is still being written, unless the bytes of both exceed ``cap`` (then the previous one is
    finished first). With ``cap`` the most bytes any single batch holds, memory never exceeds what
    writing one batch at a time (lockstep) would hold, and the making (the sources' Python work,
    a fifth of a 1B from-hf's main thread) runs beside the writes (the kernel's copies) instead of
    between them. Errors surface at the next batch or on :meth:`drain`."""

    def __init__(self, pool: ThreadPoolExecutor | None, cap: int) -> None:
        self.pool, self.cap = pool, cap
        self.pending: list[Future[None]] = []
        self.pending_bytes = 0

    def run(self, make: Callable[[], list[Callable[[], None]]], nbytes: int) -> None:
        """Make a batch (``make()``: its writes, ``nbytes`` the bytes they hold), then write it
        once the previous batch is written; returns while it is written (on one CPU: when done)."""
        if self.pool is None:
            for write in make():
                write()
            return
        if self.pending and self.pending_bytes + nbytes > self.cap:
            self.drain()
        writes = make()
        self.drain()
        self.pending = [self.pool.submit(_dropped_when_done(write)) for write in writes]
        self.pending_bytes = nbytes

    def drain(self) -> None:
        """Return when the batch being written is done (its first error raised)."""
        futures, self.pending, self.pending_bytes = self.pending, [], 0
        try:
            for future in futures:
                future.result()
        finally:  # (an error or Ctrl-C here: the other writes end before the archives do)
            wait(futures)


def _dropped_when_done(write: Callable[[], None]) -> Callable[[], None]:
    """``write`` to run once, let go of (with the record it holds) as soon as it returns: the pool
    keeps a finished task a moment longer, while the next batch is already being made."""
    box = [write]

    def run() -> None:
        box.pop()()

    return run


@contextlib.contextmanager
def writers(files: int, cap: int = 0) -> Iterator[WritePipeline]:
    """A :class:`WritePipeline` over up to one thread per CPU (inline for one file or one CPU);
    ``cap`` 0: no batch is made while another is written. On leaving, no write is running (an
    archive is only finished after its writes)."""
    workers = min(files, os.cpu_count() or 1)
    if workers < 2:
        yield WritePipeline(None, cap)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stream_save") as pool:
        pipeline = WritePipeline(pool, cap)
        try:
            yield pipeline
        finally:
            pipeline.drain()


def _record_bytes(record: torch.UntypedStorage | LazyTensor | None) -> int:
    """The bytes a record holds once made (a lazy tensor's data, a storage's size)."""
    if isinstance(record, LazyTensor):
        return _numel(tuple(record.shape)) * record.dtype.itemsize
    return 0 if record is None else record.nbytes()


def _record_writer(
    archive: _Archive, name: str, record: torch.UntypedStorage | LazyTensor
) -> Callable[[], None]:
    if isinstance(record, LazyTensor):
        return _tensor_writer(archive, name, record)
    storage = record.cpu()
    as_bytes = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[call-overload]
    return lambda: archive.write(name, storage, storage.nbytes(), lambda: crc32(as_bytes.numpy()))


def stream_save(obj: object, fh: IO[bytes]) -> None:
    """``torch.save(obj, fh)`` with each :class:`LazyTensor` of ``obj`` made only when written
    (from ``fh``'s position on: an archive after others in one file, as dcp writes them)."""
    stream_save_all([(obj, fh)])
