"""A ``torch_dist`` tensor's region as views of the mapped data files: blocks a writer copies from
where they lie (:class:`~pretrain.checkpoint.types.RowPieces`,
:class:`~pretrain.checkpoint.types.ColumnPieces`) instead of a joined copy.

``.metadata`` lists the chunks each writer rank stored, in global coordinates (``offsets``,
``sizes``). A reader's region is one index of the leading axes (a stacked layer, an expert) and all
of the axes after them. When the chunks that meet the region each span every one of those axes but
one, ``axis`` (the rows, or the last axis: the columns), and tile it without gaps, the region is
those chunks' sub-blocks in order along ``axis``; each is a contiguous view of its stored archive
over the privately mapped file (no copy, no process memory). Anything else (chunks cut along
another axis, storage transforms) is ``None``, and the caller copies the region together
(:func:`~pretrain.checkpoint.torch_dist.reader.read_region`).
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import torch

from pretrain.checkpoint.torch_dist.dcp_failures import first_line
from pretrain.checkpoint.torch_dist.dcp_meta import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from pretrain.checkpoint.torch_dist.storage import map_data_file, stored_tensor, transformed
from pretrain.utils.errors import UserError

__all__ = ["MappedTiles"]


class MappedTiles:
    """The stored chunks of the checkpoint at ``it_dir`` (dcp ``storage`` metadata) as mapped views;
    each data file is mapped and opened once."""

    def __init__(self, it_dir: Path, storage: Metadata) -> None:
        self._it_dir = it_dir
        self._storage = storage
        self._files: dict[str, tuple[torch.UntypedStorage, BinaryIO]] = {}
        self._stored: dict[MetadataIndex, torch.Tensor] = {}  # chunks loaded (each target rank asks again)

    def tiles(
        self, key: str, md: TensorStorageMetadata, lead: tuple[int, ...], axis: int
    ) -> list[torch.Tensor] | None:
        """Tensor ``key`` at index ``lead`` of its leading axes (the region ``md.size[len(lead):]``)
        as contiguous views tiling the region's ``axis`` (0: rows, -1: the last), in order; ``None``
        where the stored chunks do not tile it so."""
        rest = tuple(md.size)[len(lead) :]
        if not rest:
            return None
        ax = axis % len(rest)
        met: list[tuple[int, ChunkStorageMetadata]] = []
        for chunk in md.chunks:
            off, size = tuple(chunk.offsets), tuple(chunk.sizes)
            if not all(o <= i < o + n for i, o, n in zip(lead, off, size, strict=False)):
                continue  # another layer's or expert's chunk
            r_off, r_size = off[len(lead) :], size[len(lead) :]
            if any(r_off[d] != 0 or r_size[d] != rest[d] for d in range(len(rest)) if d != ax):
                return None  # cut along another axis
            met.append((r_off[ax], chunk))
        met.sort(key=lambda m: m[0])
        start = 0
        for begin, chunk in met:
            if begin != start:
                return None  # a gap or an overlap
            start += chunk.sizes[len(lead) + ax]
        if not met or start != rest[ax]:
            return None
        views = [self._view(key, chunk, lead, md.properties.dtype) for _, chunk in met]
        return None if any(v is None for v in views) else views  # type: ignore[return-value]

    def _view(
        self, key: str, chunk: ChunkStorageMetadata, lead: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor | None:
        """The chunk's sub-block at ``lead`` (a contiguous view), or ``None``."""
        stored = self.stored_chunk(key, chunk, dtype)
        if stored is None:
            return None
        view = stored[tuple(i - o for i, o in zip(lead, chunk.offsets, strict=False))]
        return view if view.is_contiguous() else None

    def stored_chunk(self, key: str, chunk: ChunkStorageMetadata, dtype: torch.dtype) -> torch.Tensor | None:
        """The chunk's stored tensor over the mapped file, loaded once (each target rank asks again);
        ``None`` for an item dcp must read (storage transforms) or that is not ``dtype`` and the
        chunk's shape."""
        index = MetadataIndex(key, chunk.offsets)
        if index in self._stored:
            return self._stored[index]
        info = self._storage.storage_data.get(index)
        if info is None or transformed(info):
            return None
        path = self._it_dir / info.relative_path
        if info.relative_path not in self._files:
            self._files[info.relative_path] = (map_data_file(path), open(path, "rb"))  # noqa: SIM115
        whole, fh = self._files[info.relative_path]
        try:
            stored = stored_tensor(path, whole, fh, info, key)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged archive: one line naming the file, as dcp's reads
            raise UserError(
                f"{path}: cannot read tensor {key}, truncated or corrupt? ({first_line(exc)})"
            ) from None
        if stored.dtype != dtype or tuple(stored.shape) != tuple(chunk.sizes):
            return None
        self._stored[index] = stored  # (a view of the mapped file: no memory of its own)
        return stored
