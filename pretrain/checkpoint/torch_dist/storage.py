"""The storage reader every ``torch_dist`` read goes through: dcp's file reader, with ``.metadata``
unpickled by our allow-list and read once.

``FileSystemReader.read_metadata`` calls plain ``pickle.load`` on ``.metadata``: a checkpoint from
elsewhere could run any code it names. :class:`SafeFileSystemReader` reads it with
:func:`~pretrain.checkpoint.safe_unpickle.load_dcp_metadata` instead, and keeps the result, so one
reader serves every ``dcp.load`` of a checkpoint (one region at a time) without reading it again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

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
