"""A target rank's tensor-parallel shard cut from the source's stored blocks, not from a joined copy.

A reshard (and any legacy write from a checkpoint) used to join every split tensor of the source
(a copy of the whole model, into fresh pages) and then cut each target shard out of the join. The
sources keep their tensors as blocks already: a legacy checkpoint one block of rows (column-
parallel) or columns (row-parallel) per TP rank, a ``torch_dist`` checkpoint its stored chunks
(:meth:`row_pieces`, :meth:`column_pieces`). A target shard is usually rows of one block (tp 2 ->
4: half a rank's rows) or a column range of one: a view, written from where it lies; a shard that
spans blocks (tp 4 -> 2, any -> 1) is their row runs or column ranges, gathered by the writer.

Which rows (columns) a shard takes is read off :func:`~pretrain.models.sharding.shard_tensor`
itself, run on an index probe (a float64 ``[R, 1]`` tensor whose row ``i`` holds ``i``), so the
SwiGLU blocks and GQA groups (replicated or not) follow the same rule as the joined path. Rows from
several blocks (SwiGLU's gate and up halves) stay :class:`RowPieces`, which the file writer
gathers into the shard's record (:mod:`~pretrain.checkpoint.legacy.stream_save`), as it gathers
the rows of a column range. Vocabulary tensors are cut from their stored rows (padding rows included)
and zero rows where the target pads further; expert-TP shards take the joined path.
"""

from __future__ import annotations

import numpy as np
import torch

from pretrain.checkpoint.plan import Slot
from pretrain.checkpoint.types import ColumnPieces, ColumnPieceSource, RowPieces, RowPieceSource, TensorSource
from pretrain.models.sharding import shard_tensor

__all__ = ["shard_from_pieces"]


def shard_from_pieces(
    source: TensorSource, slot: Slot, *, tp_rank: int, tp: int
) -> torch.Tensor | RowPieces | ColumnPieces | None:
    """TP rank ``tp_rank``'s shard (of ``tp``) of ``slot``'s tensor, from ``source``'s stored
    blocks: a view where it lies in one block, else the blocks' row runs as :class:`RowPieces` or
    column ranges as :class:`ColumnPieces`. A vocabulary tensor's shard is cut from the stored
    rows (padding rows included, as :func:`~pretrain.checkpoint.legacy.writer.vocab_rows`), with
    zero rows where the target's padded vocabulary is longer. ``None`` where the source does not
    keep the tensor as blocks or the shard is not cut so (the caller joins the full tensor)."""
    if slot.shards is not None or slot.dim is None:
        return None
    out: torch.Tensor | RowPieces | ColumnPieces | None
    if slot.dim == 0 and isinstance(source, RowPieceSource):
        out = _rows(source, slot, tp_rank, tp)
    elif slot.dim == 1 and isinstance(source, ColumnPieceSource) and not slot.vocab:
        out = _columns(source, slot, tp_rank, tp)
    else:
        return None
    return out if out is not None and tuple(out.shape) == tuple(slot.shape) else None


def _rows(source: RowPieceSource, slot: Slot, tp_rank: int, tp: int) -> torch.Tensor | RowPieces | None:
    pieces = source.row_pieces(slot.canonical, stored=slot.vocab)
    if pieces is None:
        return None
    if slot.vocab:  # the padded vocabulary: the stored rows that fit, then zero rows
        pieces = pieces.padded(slot.shape[0] * tp)
    rows = pieces.shape[0]
    probe = torch.arange(rows, dtype=torch.float64).reshape(rows, *([1] * (len(pieces.shape) - 1)))
    index = shard_tensor(probe, dim=0, tp_rank=tp_rank, tp=tp, layout=slot.layout, copy=False)
    taken = pieces.take(index.reshape(-1).numpy().astype(np.int64))
    return taken.parts[0] if len(taken.parts) == 1 else taken


def _columns(
    source: ColumnPieceSource, slot: Slot, tp_rank: int, tp: int
) -> torch.Tensor | ColumnPieces | None:
    pieces = source.column_pieces(slot.canonical)
    if pieces is None:
        return None
    cols = pieces.shape[1]
    probe = torch.arange(cols, dtype=torch.float64).reshape(1, cols)
    index = shard_tensor(probe, dim=1, tp_rank=tp_rank, tp=tp, layout=None, copy=False).reshape(-1).numpy()
    if index.size == 0 or not np.array_equal(index, np.arange(index[0], index[0] + index.size)):
        return None  # not one column range
    lo, hi = int(index[0]), int(index[0]) + index.size
    views, start = [], 0
    for part in pieces.parts:  # the range's columns in each block: (strided) views of them
        width = part.shape[1]
        a, b = max(lo, start), min(hi, start + width)
        if a < b:
            views.append(part if (a, b) == (start, start + width) else part[:, a - start : b - start])
        start += width
    return views[0] if len(views) == 1 else ColumnPieces(tuple(views))
