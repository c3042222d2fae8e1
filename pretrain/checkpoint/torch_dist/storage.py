"""The storage reader every ``torch_dist`` read goes through: dcp's file reader, with ``.metadata``
unpickled by our allow-list and read once, and tensors read from the mapped data files.

``FileSystemReader.read_metadata`` calls plain ``pickle.load`` on ``.metadata``: a checkpoint from
elsewhere could run any code it names. :class:`SafeFileSystemReader` reads it with
:func:`~pretrain.checkpoint.safe_unpickle.load_dcp_metadata` instead, and keeps the result, so one
reader serves every ``dcp.load`` of a checkpoint (one region at a time) without reading it again.

Each stored tensor is a ``torch.save`` archive inside a ``.distcp`` file. dcp's reader reads the
archive through a file stream into a new tensor and then copies it into the target: two copies of
every byte. Here the data file is memory-mapped (``UntypedStorage.from_file``, private: the
kernel's page-cache pages, not process memory) and the archive is loaded over its mapped bytes, as
``torch.load(mmap=True)`` loads a file, with torch's ``weights_only`` unpickler: one copy, into the
target. Items with dcp storage transforms (compression, a later format) go dcp's way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch._weights_only_unpickler as weights_only_unpickler
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from pretrain.checkpoint.safe_unpickle import load_dcp_metadata
from pretrain.utils.errors import UserError

METADATA_FILE = ".metadata"


def read_dcp_metadata(it_dir: Path) -> Metadata:
    """``it_dir/.metadata`` through the restricted unpickler (one line on anything else)."""
    path = it_dir / METADATA_FILE
    md = load_dcp_metadata(path)
    if not isinstance(md, Metadata):
        raise UserError(f"{path}: holds a {type(md).__name__}, not torch.distributed.checkpoint Metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """dcp's ``FileSystemReader`` of ``it_dir`` whose metadata is ``metadata`` (read safely when not given)."""

    def __init__(self, it_dir: Path, metadata: Metadata | None = None) -> None:
        super().__init__(str(it_dir))
        self._it_dir = it_dir
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = read_dcp_metadata(self._it_dir)
        if getattr(self._metadata, "storage_meta", None) is None:  # what torch's reader does too
            self._metadata.storage_meta = StorageMeta()
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Tensor items from the mapped data files (module docstring); the rest as dcp reads them."""
        mapped = [r for r in plan.items if r.type != LoadItemType.BYTE_IO and not self._transformed(r)]
        rest = [r for r in plan.items if r not in mapped]
        if rest:
            super().read_data(LoadPlan(rest), planner).wait()
        per_file: dict[str, list[ReadItem]] = {}
        for item in mapped:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            self._read_mapped(self._it_dir / relative_path, items, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _transformed(self, item: ReadItem) -> bool:
        return bool(getattr(self.storage_data[item.storage_index], "transform_descriptors", None))

    def _read_mapped(self, path: Path, items: list[ReadItem], planner: LoadPlanner) -> None:
        """Copy each item's region of its stored tensor into the planner's target."""
        whole = map_data_file(path)
        with open(path, "rb") as fh:
            for item in items:
                stored = self.stored_tensor(path, whole, fh, item.storage_index)
                region = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != region.size():
                    raise UserError(
                        f"{path}: tensor {item.storage_index.fqn} region {tuple(region.shape)} != "
                        f"{tuple(target.shape)} expected"
                    )
                target.copy_(region)
                planner.commit_tensor(item, target)

    def stored_tensor(
        self, path: Path, whole: torch.UntypedStorage, fh: BinaryIO, index: MetadataIndex
    ) -> torch.Tensor:
        """The tensor stored under ``index`` in the data file ``path`` (open as ``fh``, mapped as
        ``whole`` by :func:`map_data_file`): its archive loaded over the mapped bytes, a view of
        the file's pages (no copy)."""
        assert self._metadata is not None
        info = self._metadata.storage_data[index]
        if info.offset + info.length > whole.nbytes():
            raise UserError(f"{path}: ends before tensor {index.fqn} (truncated?)")
        archive = torch._C.PyTorchFileReader(self._slice_file(fh, info))
        stored = torch.serialization._load(  # type: ignore[attr-defined]
            archive,
            "cpu",
            weights_only_unpickler,
            overall_storage=whole[info.offset : info.offset + info.length],
        )
        if not isinstance(stored, torch.Tensor):
            raise UserError(f"{path}: tensor {index.fqn} holds a {type(stored).__name__}")
        return stored


def map_data_file(path: Path) -> torch.UntypedStorage:
    """The data file ``path`` mapped privately: the page cache's pages, read on first touch."""
    return torch.UntypedStorage.from_file(str(path), shared=False, nbytes=os.path.getsize(path))  # type: ignore[return-value]
