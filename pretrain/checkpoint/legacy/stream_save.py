"""``torch.save`` files written one tensor at a time: a rank file never whole in memory.

``torch.save`` writes a zip archive: ``data.pkl`` (the pickled object, each tensor's storage
named by a persistent id ``("storage", <dtype>Storage, key, location, numel)``), a few small
records, then one record ``data/<key>`` per storage in the order the pickle met them. The pickle
needs only each tensor's dtype and shape, so :func:`stream_save` pickles an object whose model
tensors are :class:`LazyTensor` placeholders (dtype, shape, and a function making the data), then
makes each tensor just before its record is written and drops it at once: memory stays at one
tensor, whatever the file's size. Real tensors in the object (optimizer state, RNG state) are
written as ``torch.save`` writes them.

The bytes are those ``torch.save`` writes for the same object with real tensors (the same
pickle, the records in the same order, through torch's own zip writer with its CRC-32 and
alignment settings; ``tests/test_stream_save.py``), so ``torch.load(weights_only=True)`` and
megatron-core read the files as before.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO

import torch
import torch.serialization as ser


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """A contiguous tensor of ``dtype`` and ``shape`` that ``make()`` produces when it is written."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]

    def __reduce_ex__(self, protocol: object) -> tuple[object, ...]:
        """What a contiguous CPU tensor reduces to (``torch.Tensor._reduce_ex_internal``)."""
        if self.dtype in torch.storage._new_dtypes():  # the v3 rebuild path: a real tensor, made now
            return self.make().__reduce_ex__(protocol)  # type: ignore[arg-type]
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


def _write_tensor(zf: torch._C.PyTorchFileWriter, name: str, lazy: LazyTensor) -> None:
    t = lazy.make()
    if t.dtype != lazy.dtype or tuple(t.shape) != tuple(lazy.shape):
        raise RuntimeError(
            f"stream_save: {name} was announced as {lazy.dtype} {tuple(lazy.shape)}, "
            f"made as {t.dtype} {tuple(t.shape)}"
        )
    t = t.detach().to("cpu").contiguous()
    nbytes = t.numel() * t.element_size()
    # its bytes where they lie: a view of a larger storage (a TP shard cut from the full tensor)
    # is written from a storage slice, which shares the memory (no copy first)
    start = t.storage_offset() * t.element_size()
    zf.write_record(name, t.untyped_storage()[start : start + nbytes], nbytes)  # type: ignore[arg-type]


def _begin(
    obj: object, fh: IO[bytes]
) -> tuple[torch._C.PyTorchFileWriter, list[torch.UntypedStorage | LazyTensor]]:
    """Write ``obj``'s pickle and the small records; the storages still to write, in order."""
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(obj)
    data = buf.getvalue()
    zf = torch._C.PyTorchFileWriter(fh, ser.get_crc32_options(), ser._get_storage_alignment())
    zf.write_record("data.pkl", data, len(data))
    for record, value in ((".format_version", "1"), (".storage_alignment", str(ser._get_storage_alignment())),
                          ("byteorder", sys.byteorder)):  # fmt: skip
        zf.write_record(record, value.encode(), len(value))
    return zf, pickler.records


def stream_save_all(files: Sequence[tuple[object, IO[bytes]]]) -> None:
    """``torch.save(obj, fh)`` for every pair, each :class:`LazyTensor` made only when written.

    The files are written in lockstep, record ``k`` of every file before record ``k + 1`` of any:
    files of the same layout (a pipeline stage's TP ranks) then ask for the same source tensor one
    after another, which a one-tensor cache in the caller turns into one read."""
    started: list[tuple[torch._C.PyTorchFileWriter, list[torch.UntypedStorage | LazyTensor]]] = []
    try:
        for obj, fh in files:
            started.append(_begin(obj, fh))
        for key in range(max((len(records) for _, records in started), default=0)):
            for zf, records in started:
                if key < len(records):
                    _write_record(zf, f"data/{key}", records[key])
                    records[key] = None  # type: ignore[call-overload]  # dropped: one made tensor at a time
    finally:
        # finish every archive while its file is open (also on an error or Ctrl-C: a writer left to
        # the garbage collector would finish it into a closed file and abort the process)
        for zf, _ in started:
            zf.write_end_of_file()
        started.clear()
    for _, fh in files:
        fh.flush()


def _write_record(
    zf: torch._C.PyTorchFileWriter, name: str, record: torch.UntypedStorage | LazyTensor
) -> None:
    if isinstance(record, LazyTensor):
        _write_tensor(zf, name, record)
    else:
        zf.write_record(name, record.cpu(), record.nbytes())  # type: ignore[arg-type]


def stream_save(obj: object, fh: IO[bytes]) -> None:
    """``torch.save(obj, fh)`` with each :class:`LazyTensor` of ``obj`` made only when written."""
    stream_save_all([(obj, fh)])
