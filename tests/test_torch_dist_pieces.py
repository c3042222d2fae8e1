"""A ``torch_dist`` checkpoint's tensors as views of its mapped data files
(:mod:`pretrain.checkpoint.torch_dist.mapped`): the stored chunks tile a region's rows or columns,
and to-hf writes the HF tensors from them byte for byte what the read-and-joined path writes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

import pretrain.checkpoint.torch_dist.reader as torch_dist_reader
import tools.hf_io
from pretrain.checkpoint.opener import open_checkpoint
from pretrain.checkpoint.torch_dist.mapped import MappedTiles
from tests.convert_fixtures import write_bf16_llama_torch_dist
from tools.convert_cli import main

os.environ["HF_HUB_OFFLINE"] = "1"


def _md(
    size: tuple[int, ...], chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]
) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.bfloat16),
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )


@pytest.fixture
def geometry_only(monkeypatch: pytest.MonkeyPatch) -> MappedTiles:
    """Tiles whose views are stand-ins naming the chunk (the chunk geometry alone under test)."""
    monkeypatch.setattr(
        MappedTiles, "_view", lambda self, key, chunk, lead, dtype: torch.tensor(chunk.offsets)
    )
    return MappedTiles.__new__(MappedTiles)


# a stacked [layers, rows, cols] tensor, per layer chunks cut by TP ranks along rows or columns
ROWS = [((layer, r, 0), (1, 4, 6)) for layer in range(2) for r in (0, 4)]
COLS = [((layer, 0, c), (1, 8, 3)) for layer in range(2) for c in (0, 3)]


def test_chunks_tiling_the_rows_of_a_layer_are_its_row_pieces(geometry_only: MappedTiles) -> None:
    views = geometry_only.tiles(
        "k", _md((2, 8, 6), ROWS[::-1]), (1,), 0
    )  # in row order, whatever the listing
    assert views is not None and [v.tolist() for v in views] == [[1, 0, 0], [1, 4, 0]]
    assert geometry_only.tiles("k", _md((2, 8, 6), ROWS), (1,), -1) is None  # not whole rows


def test_chunks_tiling_the_columns_of_a_layer_are_its_column_pieces(geometry_only: MappedTiles) -> None:
    views = geometry_only.tiles("k", _md((2, 8, 6), COLS), (0,), -1)
    assert views is not None and [v.tolist() for v in views] == [[0, 0, 0], [0, 0, 3]]
    assert geometry_only.tiles("k", _md((2, 8, 6), COLS), (0,), 0) is None


@pytest.mark.parametrize(
    "chunks",
    [
        [((0, 0, 0), (1, 4, 6)), ((0, 5, 0), (1, 3, 6))],  # a gap
        [((0, 0, 0), (1, 5, 6)), ((0, 4, 0), (1, 4, 6))],  # an overlap
        [((0, 0, 0), (1, 4, 6))],  # short of the rows
        [((0, 0, 0), (2, 8, 6))],  # two layers in one chunk: a sub-block, fine (see below)
    ],
)
def test_chunks_that_do_not_tile_the_rows_are_refused(
    geometry_only: MappedTiles, chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]
) -> None:
    views = geometry_only.tiles("k", _md((2, 8, 6), chunks), (0,), 0)
    assert (views is not None) == (chunks[0][1][0] == 2)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)])
def test_to_hf_from_torch_dist_pieces_is_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int, pp: int
) -> None:
    write_bf16_llama_torch_dist(tmp_path / "ck", tp=tp, pp=pp)
    reader = open_checkpoint(tmp_path / "ck")
    for name in reader.names():  # the views are the tensors
        rows, cols = reader.row_pieces(name), reader.column_pieces(name)  # type: ignore[attr-defined]
        want = reader.tensor(name)
        assert rows is None or torch.equal(torch.cat(rows.parts), want), name
        assert cols is None or torch.equal(torch.cat(cols.parts, dim=1), want), name
    reads: list[str] = []
    real = torch_dist_reader.read_region

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        reads.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_dist_reader, "read_region", counted)
    outs = {}
    for pieces in (True, False):
        monkeypatch.setattr(tools.hf_io, "ROW_PIECES", pieces)
        outs[pieces] = tmp_path / f"hf_{pieces}"
        argv = [
            "to-hf",
            "--weights-only",
            "--no-verify",
            "--load",
            str(tmp_path / "ck"),
            "--save",
            str(outs[pieces]),
        ]
        assert main(argv) == 0
        if pieces:
            assert reads == []  # every HF tensor written from the mapped files' views
    assert reads  # (the other way reads them)
    files = sorted(p.name for p in outs[True].iterdir())
    assert files == sorted(p.name for p in outs[False].iterdir())
    for name in files:
        assert (outs[True] / name).read_bytes() == (outs[False] / name).read_bytes(), name
