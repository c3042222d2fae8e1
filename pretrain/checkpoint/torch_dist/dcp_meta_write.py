"""A ``torch_dist`` ``.metadata`` file written without importing ``torch.distributed.checkpoint``.

Importing dcp costs 0.9-1.2 s on a 2-core host (``torch.distributed.tensor`` and sympy come with
it), a third of a 1B conversion. The ``.metadata`` of a save is one pickle of dcp's ``Metadata``
dataclass; :func:`write_dcp_metadata` builds the same object graph from the stand-in classes of
:mod:`~pretrain.checkpoint.torch_dist.dcp_meta` (the ones the reader unpickles into) and pickles it
with a pickler that names each stand-in class by dcp's module and class name (:data:`_DCP_NAMES`),
so the bytes are those ``FileSystemWriter.finish`` writes: ``pickle.dump`` at the default protocol
of ``Metadata(state_dict_metadata, planner_data={}, storage_data, StorageMeta(checkpoint_id,
save_id), version)``, through ``.metadata.tmp`` renamed. ``tests/test_dcp_meta_write.py`` proves
it byte for byte against dcp's own save (the random ``save_id`` made equal), which also catches
a torch release that changes the format (:data:`DCP_VERSION`, a field).

Object identity matters to a pickle (a second reference to an object is a memo lookup, not a
copy), so the builders below share objects where dcp's planner does: a key's name string in
``state_dict_metadata`` and in its ``MetadataIndex``; one ``TensorProperties`` per key; the file
name string among its items.
"""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import torch

from pretrain.checkpoint.torch_dist.dcp_meta import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MemoryFormatCode,
    Metadata,
    MetadataIndex,
    StorageInfo,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION (torch 2.4-2.13)
_MODULE = "torch.distributed.checkpoint.metadata"


_DCP_NAMES: dict[type, tuple[str, str]] = {
    Metadata: (_MODULE, "Metadata"),
    StorageMeta: (_MODULE, "StorageMeta"),
    MetadataIndex: (_MODULE, "MetadataIndex"),
    TensorStorageMetadata: (_MODULE, "TensorStorageMetadata"),
    BytesStorageMetadata: (_MODULE, "BytesStorageMetadata"),
    ChunkStorageMetadata: (_MODULE, "ChunkStorageMetadata"),
    TensorProperties: (_MODULE, "TensorProperties"),
    MemoryFormatCode: (_MODULE, "_MEM_FORMAT_ENCODING"),
    StorageInfo: ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}


# the pure-Python pickler: its save_global can be overridden (typeshed declares none of its
# internals: save, write, memoize, proto)
_PurePickler: Any = pickle._Pickler


class _DcpPickler(_PurePickler):  # type: ignore[misc]
    """The pure-Python pickler (its output equals the C one's), naming each stand-in class as dcp's
    class (``STACK_GLOBAL`` of module and name, memoised) without importing that module."""

    def save_global(self, obj: object, name: str | None = None) -> None:
        where = _DCP_NAMES.get(obj) if isinstance(obj, type) else None
        if where is None:
            super().save_global(obj, name)
            return
        assert self.proto >= 4  # (STACK_GLOBAL; the default protocol is 4 or 5)
        self.save(where[0])
        self.save(where[1])
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


@dataclass(frozen=True)
class StoredChunk:
    """One tensor chunk as the save plan has it: at ``offsets`` of the global tensor (``size``,
    ``dtype``), ``sizes`` long."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    size: tuple[int, ...]
    dtype: torch.dtype


class PlannedItem(Protocol):
    """One item of a rank's save plan (dcp's ``WriteItem``): ``key``'s ``chunk``, or with
    ``chunk`` None a byte entry (a ``torch.save``d object)."""

    @property
    def key(self) -> str: ...
    @property
    def chunk(self) -> StoredChunk | None: ...


@dataclass(frozen=True)
class StoredItem:
    """Where one planned item was written: ``relative_path`` (``__<rank>_<i>.distcp``),
    ``offset`` and ``length`` in bytes."""

    key: str
    chunk: StoredChunk | None
    relative_path: str
    offset: int
    length: int


def build_metadata(
    plans: Sequence[Sequence[PlannedItem]],
    written: Sequence[Sequence[StoredItem]],
    *,
    checkpoint_id: Path,
    save_id: str,
) -> Metadata:
    """dcp's ``Metadata`` of a save, as ``create_default_global_save_plan`` and
    ``FileSystemWriter.finish`` make it from every rank's ``plans`` (in rank order, each in plan
    order) and what each rank ``written`` (in its write order): the keys in the order their first
    item is planned, each tensor key's chunks in plan order, ``storage_data`` in write order keyed
    by ``MetadataIndex(key, offsets, index=<the chunk's place among the key's>)`` (a byte entry's
    by ``MetadataIndex(key)``)."""
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    place: dict[tuple[str, tuple[int, ...]], int] = {}
    for item in (i for items in plans for i in items):
        chunk = item.chunk
        if chunk is None:
            state[item.key] = BytesStorageMetadata()
            continue
        md = state.get(item.key)
        if md is None:
            md = state[item.key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=chunk.dtype), size=torch.Size(chunk.size), chunks=[]
            )
        assert isinstance(md, TensorStorageMetadata)
        place[(item.key, chunk.offsets)] = len(md.chunks)
        md.chunks.append(
            ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes))
        )
    storage: dict[MetadataIndex, StorageInfo] = {}
    for done in (d for items in written for d in items):
        index = (
            MetadataIndex(done.key)
            if done.chunk is None
            else MetadataIndex(done.key, done.chunk.offsets, place[(done.key, done.chunk.offsets)])
        )
        # (the field order is the pickle's)
        storage[index] = StorageInfo(relative_path=done.relative_path, offset=done.offset, length=done.length)
    meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id, load_id=None, modules=[])
    return Metadata(
        state_dict_metadata=state,
        planner_data={},
        storage_data=storage,
        storage_meta=meta,
        version=DCP_VERSION,
    )


def dump_metadata(metadata: Metadata, fh: IO[bytes]) -> None:
    """``pickle.dump(metadata, fh)`` as dcp's classes (at ``pickle.DEFAULT_PROTOCOL``)."""
    _DcpPickler(fh, pickle.DEFAULT_PROTOCOL).dump(metadata)


def write_dcp_metadata(it_dir: Path, metadata: Metadata) -> None:
    """``it_dir/.metadata``, as ``FileSystemWriter.finish`` writes it: ``.metadata.tmp``, fsynced,
    renamed."""
    tmp = it_dir / ".metadata.tmp"
    with open(tmp, "wb") as fh:
        dump_metadata(metadata, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, it_dir / ".metadata")


def new_save_id() -> str:
    """A save's id, as dcp makes it (``str(uuid.uuid4())``)."""
    return str(uuid.uuid4())
