"""HF tensors that are whole rows of one checkpoint tensor, written from where those rows lie.

A legacy checkpoint keeps a column-parallel tensor as one block of rows per tensor-parallel rank
(:meth:`LegacyReader.row_pieces <pretrain.checkpoint.legacy.reader.LegacyReader.row_pieces>`).
Most of a decoder's HF tensors are whole rows of such a tensor: ``q_proj``/``k_proj``/``v_proj``
are row groups of the fused QKV, ``gate_proj``/``up_proj`` the two halves of ``fc1``, the
embeddings and output layer the vocabulary's rows. Joining the ranks' blocks and then copying the
split views contiguous cost a 3B ``to-hf`` 4.5 of its 13 s; the rows can instead be written from
the mapped checkpoint files as they are.

Which rows each output takes is read off the family's own mapping, run on probes: a float64
tensor ``[R, 1, ...]`` whose row ``i`` holds ``i`` (and a second, ``2 i + 7``, to tell selection
from arithmetic). An output that is a row selection comes out as its rows' indices in both; any
other step (a transpose, a cast, a reshape of the row contents, arithmetic) does not, and that
source is then converted as before. The dtype must stay the source's: the bytes are the source's.

A row-parallel tensor (``o_proj``, ``down_proj``) is kept as one block of columns per rank; when
the family's mapping passes it through unchanged, its HF tensor is those blocks' rows gathered in
order (:class:`ColumnPieces`), again with no join. "Unchanged" is read off a probe whose memory is
never touched (``torch.empty`` of the source's shape): the mapping must hand back that very tensor
(same storage, shape and strides) and must not have written into it (its version counter, which
every in-place op bumps, is as it was). Any copy, transpose, cast or arithmetic makes a different
tensor, and the source is converted as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from pretrain.checkpoint.types import ColumnPieces, RowPieces

__all__ = ["row_selected", "unchanged"]

Run = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class Planned(Protocol):
    """An HF tensor as the export plan announces it (:class:`tools.hf_plan.Planned`)."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


def row_selected(
    run: Run, source: str, pieces: RowPieces, outputs: Sequence[Planned]
) -> dict[str, RowPieces] | None:
    """Each of ``outputs`` (``source``'s HF tensors, as planned) as runs of ``pieces``' rows, or
    ``None`` when the mapping ``run`` (canonical tensors -> HF tensors) does more than select
    whole rows of ``source`` for any of them."""
    shape = pieces.shape
    rows = shape[0]
    if (
        not outputs
        or rows >= 2**52
        or any(p.dtype != pieces.dtype or p.shape[1:] != tuple(shape[1:]) for p in outputs)
    ):
        return None
    probe = torch.arange(rows, dtype=torch.float64).reshape(rows, *([1] * (len(shape) - 1)))
    try:
        made, made2 = run({source: probe}), run({source: probe * 2 + 7})
    except Exception:  # noqa: BLE001 - the mapping needs the real row contents: not a selection
        return None
    selected = {}
    for planned in outputs:
        index = _row_index(made.get(planned.name), planned, len(shape), rows)
        index2 = _row_index(made2.get(planned.name), planned, len(shape), None)
        if index is None or index2 is None or not np.array_equal(index2, index * 2 + 7):
            return None
        selected[planned.name] = pieces.take(index.astype(np.int64))
    return selected


def _row_index(made: torch.Tensor | None, planned: Planned, ndim: int, rows: int | None) -> np.ndarray | None:
    """The probe's output as row indices ``[n]`` (float64), if it has the planned rows, one value per
    row and (given ``rows``) only whole indices below ``rows``. In NumPy: these small single
    passes cost more as torch ops (an OpenMP region each) than they compute."""
    if made is None or made.dtype != torch.float64 or made.device.type != "cpu":
        return None
    if tuple(made.shape) != (planned.shape[0], *([1] * (ndim - 1))):
        return None
    index = made.reshape(-1).numpy()
    if (
        rows is not None
        and index.size
        and (not np.array_equal(index, np.round(index)) or index.min() < 0 or index.max() >= rows)
    ):
        return None
    return index


def unchanged(run: Run, source: str, pieces: ColumnPieces, outputs: Sequence[Planned]) -> str | None:
    """The one output of ``outputs`` that the mapping ``run`` makes by passing ``source`` through
    as it is (so its bytes are ``pieces``' rows gathered), else ``None``."""
    if len(outputs) != 1 or outputs[0].dtype != pieces.dtype or outputs[0].shape != tuple(pieces.shape):
        return None
    probe = torch.empty(tuple(pieces.shape), dtype=pieces.dtype)  # untouched pages: no memory used
    version = probe._version
    try:
        made = run({source: probe}).get(outputs[0].name)
    except Exception:  # noqa: BLE001 - the mapping needs the real contents: not a pass-through
        return None
    if (
        made is None
        or made.dtype != probe.dtype
        or made.shape != probe.shape
        or made.stride() != probe.stride()
        or made.data_ptr() != probe.data_ptr()
        or made.device != probe.device
        or probe._version != version  # written in place
    ):
        return None
    return outputs[0].name
