"""The stored items of a ``torch_dist`` checkpoint, read from the mapped data files without dcp.

Each stored tensor is a ``torch.save`` archive inside a ``.distcp`` file, at the ``offset`` and
``length`` its ``.metadata`` entry gives (:mod:`~pretrain.checkpoint.torch_dist.dcp_meta`). dcp's
reader reads the archive through a file stream into a new tensor and then copies it into the
target: two copies of every byte. Here the data file is memory-mapped
(``UntypedStorage.from_file``, private: the kernel's page-cache pages, not process memory) and
the archive is loaded over its mapped bytes, as ``torch.load(mmap=True)`` loads a file, with
torch's ``weights_only`` unpickler: a view, copied once into the target. A stored object
(``BYTE_IO``: megatron-core's ``common_state``) is its raw bytes, as dcp's writer wrote them.

Nothing here imports ``torch.distributed.checkpoint`` (seconds on a small host): items with dcp
storage transforms (compression, a later format) are read by dcp itself
(:mod:`~pretrain.checkpoint.torch_dist.storage_dcp`), which the callers import only for them.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import BinaryIO

import torch
import torch._weights_only_unpickler as weights_only_unpickler

from pretrain.checkpoint.torch_dist.dcp_meta import StorageInfo
from pretrain.utils.errors import UserError

METADATA_FILE = ".metadata"


def map_data_file(path: Path) -> torch.UntypedStorage:
    """The data file ``path`` mapped privately: the page cache's pages, read on first touch."""
    return torch.UntypedStorage.from_file(str(path), shared=False, nbytes=os.path.getsize(path))  # type: ignore[return-value]


class _FileWindow(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a file of their own (what
    ``PyTorchFileReader`` reads an archive's directory and records from)."""

    def __init__(self, fh: BinaryIO, offset: int, length: int) -> None:
        super().__init__()
        self._fh, self._offset, self._length = fh, offset, length
        self.seek(0)

    def seek(self, pos: int, whence: int = os.SEEK_SET, /) -> int:
        if whence == os.SEEK_SET:
            where = self._offset + pos
        elif whence == os.SEEK_END:
            where = self._offset + self._length + pos
        else:
            where = self._fh.tell() + pos
        return self._fh.seek(where) - self._offset

    def tell(self) -> int:
        return self._fh.tell() - self._offset

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        room = max(0, self._length - self.tell())
        view = memoryview(b)[:room]
        return self._fh.readinto(view) if room else 0  # type: ignore[attr-defined]


def transformed(info: StorageInfo) -> bool:
    """Whether the item's bytes went through dcp storage transforms (then dcp reads it)."""
    return bool(getattr(info, "transform_descriptors", None))


def stored_tensor(
    path: Path, whole: torch.UntypedStorage, fh: BinaryIO, info: StorageInfo, fqn: str
) -> torch.Tensor:
    """The tensor stored at ``info`` in the data file ``path`` (open as ``fh``, mapped as ``whole``
    by :func:`map_data_file`): its archive loaded over the mapped bytes, a view of the file's pages
    (no copy)."""
    if info.offset + info.length > whole.nbytes():
        raise UserError(f"{path}: ends before tensor {fqn} (truncated?)")
    archive = torch._C.PyTorchFileReader(_FileWindow(fh, info.offset, info.length))  # type: ignore[call-overload]
    stored = torch.serialization._load(  # type: ignore[attr-defined]
        archive,
        "cpu",
        weights_only_unpickler,
        overall_storage=whole[info.offset : info.offset + info.length],
    )
    if not isinstance(stored, torch.Tensor):
        raise UserError(f"{path}: tensor {fqn} holds a {type(stored).__name__}")
    return stored


def stored_bytes(path: Path, info: StorageInfo) -> bytes:
    """A stored object's raw bytes (what dcp's writer wrote for a ``BYTE_IO`` item)."""
    with open(path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    if len(data) != info.length:
        raise UserError(f"{path}: ends before its stored object (truncated?)")
    return data
