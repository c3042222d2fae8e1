"""dcp's own file reader for the ``torch_dist`` items our reader leaves to it (storage transforms:
compression, a later format), with ``.metadata`` unpickled by our allow-list into dcp's real
classes and read once (importing this module imports ``torch.distributed.checkpoint``).

``FileSystemReader.read_metadata`` calls plain ``pickle.load`` on ``.metadata``: a checkpoint from
elsewhere could run any code it names. :class:`SafeFileSystemReader` reads it with
:func:`~pretrain.checkpoint.safe_unpickle.load_dcp_metadata` instead, and keeps the result, so one
reader serves every ``dcp.load`` of a checkpoint without reading it again. Plain tensor items are
read from the mapped data files (:func:`~pretrain.checkpoint.torch_dist.storage.stored_tensor`).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from pretrain.checkpoint.safe_unpickle import load_dcp_metadata
from pretrain.checkpoint.torch_dist import storage
from pretrain.checkpoint.torch_dist.dcp_failures import dcp_failures, first_line
from pretrain.utils.errors import UserError


def read_real_dcp_metadata(it_dir: Path) -> Metadata:
    """``it_dir/.metadata`` as dcp's own classes, through the restricted unpickler (one line on
    anything else)."""
    path = it_dir / storage.METADATA_FILE
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
            self._metadata = read_real_dcp_metadata(self._it_dir)
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
        whole = storage.map_data_file(path)
        with open(path, "rb") as fh:
            for item in items:
                info = self.storage_data[item.storage_index]
                stored = storage.stored_tensor(path, whole, fh, info, item.storage_index.fqn)
                region = stored
                for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    region = region.narrow(dim, start, length)
                target = planner.resolve_tensor(item).detach()
                if target.size() != region.size():
                    raise UserError(
                        f"{path}: tensor {item.storage_index.fqn} region {tuple(region.shape)} != "
                        f"{tuple(target.shape)} expected"
                    )
                target.copy_(region)
                planner.commit_tensor(item, target)


class _RegionPlanner(DefaultLoadPlanner):
    """Load one region (``offsets``, the shape of ``out``) of the stored tensor ``key`` into ``out``."""

    def __init__(self, key: str, out: torch.Tensor, offsets: tuple[int, ...]) -> None:
        super().__init__()
        self.key, self.out, self.offsets = key, out, offsets
        self.files: list[str] = []

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata[self.key]  # type: ignore[union-attr]
        chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.out.shape)
        items = create_read_items_for_chunk_list(self.key, md, [chunk])  # type: ignore[arg-type]
        storage_data = self.metadata.storage_data or {}  # type: ignore[union-attr]
        self.files = sorted({getattr(storage_data.get(i.storage_index), "relative_path", "?") for i in items})
        return LoadPlan(items)

    def where(self, path: Path) -> str:
        """The data file(s) the region is read from (the directory until the plan is made)."""
        return ", ".join(str(path / f) for f in self.files) if self.files else str(path)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        t = self.out
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            t = t.narrow(dim, start, length)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class _BytesPlanner(DefaultLoadPlanner):
    """Keep the raw bytes of a stored object: DCP's own ``load_bytes`` would
    ``torch.load(weights_only=False)`` them, running whatever an untrusted file's pickle names."""

    data: bytes = b""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.data = value.read()


def dcp_read_region(path: Path, key: str, out: torch.Tensor, offsets: tuple[int, ...]) -> None:
    """Fill ``out`` with the region of stored tensor ``key`` at ``offsets`` by ``dcp.load`` (one
    line naming the data files on a failure)."""
    planner = _RegionPlanner(key, out, offsets)

    def describe(exc: BaseException) -> str:
        return f"{planner.where(path)}: cannot read tensor {key}, truncated or corrupt? ({first_line(exc)})"

    _load({}, path, planner, describe)


def dcp_read_bytes(it_dir: Path, key: str) -> bytes:
    """The raw bytes of stored object ``key`` by ``dcp.load``."""
    planner = _BytesPlanner()

    def describe(exc: BaseException) -> str:
        return f"{it_dir}: cannot read {key}, truncated or corrupt? ({first_line(exc)})"

    _load({key: io.BytesIO()}, it_dir, planner, describe)
    return planner.data


def _load(
    state: dict[str, Any], path: Path, planner: DefaultLoadPlanner, describe: Callable[[BaseException], str]
) -> None:
    try:
        with dcp_failures(describe), warnings.catch_warnings():  # "assuming ... a single process": intended
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=planner, no_dist=True)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(describe(exc)) from None
