"""The fingerprint hashes a legacy checkpoint's column-parallel shards where they lie (``row_pieces``),
and its row-parallel shards row by row (``column_pieces``): the same value as the joined tensors,
with no joined copy made."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pretrain.checkpoint import fingerprint
from pretrain.checkpoint.fingerprint import tensor_digest, weights_fingerprint
from pretrain.checkpoint.legacy.writer import DictSource, WriteOptions, write_layout
from pretrain.checkpoint.opener import open_checkpoint
from pretrain.checkpoint.plan import ModelSpec
from pretrain.checkpoint.types import ColumnPieces, RowPieces, RowPieceSource
from pretrain.parallel.config import ParallelConfig
from pretrain.utils import buffer_pool, gathered_write
from tests.gpt_fixtures import full_weights
from tests.llama_fixtures import llama_config

CFG = llama_config()  # SwiGLU blocks, GQA 8/2, untied head, vocabulary 1003 padded per TP


def _weights(dtype: torch.dtype, *, bf16_values: bool) -> dict[str, torch.Tensor]:
    full = full_weights(CFG)
    if bf16_values:  # float32 numbers that are all bf16 numbers: hashed as bf16 ("b")
        return {k: v.to(torch.bfloat16).to(dtype) for k, v in full.items()}
    return {k: v.to(dtype) for k, v in full.items()}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(
    ("dtype", "bf16_values"), [(torch.bfloat16, True), (torch.float32, False), (torch.float32, True)]
)
def test_pieces_give_the_joined_tensors_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int, dtype: torch.dtype, bf16_values: bool
) -> None:
    full = _weights(dtype, bf16_values=bf16_values)
    write_layout(DictSource(ModelSpec(kind="gpt", cfg=CFG), full), tmp_path / "ckpt", ParallelConfig(tp=tp, pp=1),
                 options=WriteOptions(iteration="release"))  # fmt: skip
    reader = open_checkpoint(tmp_path / "ckpt")
    pieced = [n for n in reader.names() if reader.row_pieces(n) is not None]
    # the embedding, output layer and fc1 of every layer, and QKV while each rank holds whole
    # query groups (2 groups: not at tp4, where the key/value heads are replicated)
    qkv = CFG.num_layers if tp <= 2 else 0
    assert len(pieced) == 2 + CFG.num_layers + qkv, pieced
    for name in pieced:
        pieces = reader.row_pieces(name)
        assert pieces is not None and pieces.shape == reader.tensor(name).shape
        assert torch.equal(torch.cat(pieces.parts), reader.tensor(name)), name
        assert tensor_digest(name, pieces) == tensor_digest(name, reader.tensor(name)), name
        assert tensor_digest(name, pieces, scheme="w1") == tensor_digest(
            name, reader.tensor(name), scheme="w1"
        )

    released: list[torch.Tensor] = []
    if reader.pages is not None:  # pieces drop their mapped pages from RSS once hashed, as joins do
        real_release = reader.pages.release
        monkeypatch.setattr(reader.pages, "release", lambda t: released.append(t) or real_release(t))
    joins: list[int] = []
    real_cat = buffer_pool.pooled_cat
    monkeypatch.setattr(
        "pretrain.models.sharding.pooled_cat", lambda ts, dim=0: joins.append(dim) or real_cat(ts, dim)
    )
    assert weights_fingerprint(reader) == weights_fingerprint(full)
    assert joins == []  # the row-parallel tensors (dense, fc2) too: hashed row by row, never joined
    if reader.pages is not None:
        assert len(released) >= sum(len(reader.row_pieces(n).parts) for n in pieced)  # type: ignore[union-attr]


@pytest.mark.parametrize("widths", [(3, 5), (40_000, 1, 32_768)], ids=["staged-rows", "long-rows"])
@pytest.mark.parametrize(
    "values", ["bf16", "bf16-as-float32", "float32", "float16", "int64"]
)  # each kind of the w2 rule: "b" stored or found, "f", "i"
def test_column_pieces_give_the_joined_tensors_digest(
    monkeypatch: pytest.MonkeyPatch, widths: tuple[int, ...], values: str
) -> None:
    """Each row of each block in turn is the joined tensor's value stream: short rows are joined a
    few at a time in the staging buffer (made tiny here, so a tensor takes several steps), rows of
    64 KB or more are hashed where they lie."""
    monkeypatch.setattr(gathered_write, "_STAGE_BYTES", 64)
    gen = torch.Generator().manual_seed(0)
    parts = tuple(torch.randn(7, w, generator=gen) for w in widths)
    if values == "int64":
        parts = tuple((p * 1000).to(torch.int64) for p in parts)
    elif values != "float32":
        dtype = {"bf16": torch.bfloat16, "bf16-as-float32": torch.float32, "float16": torch.float16}[values]
        parts = tuple(p.to(torch.bfloat16 if values.startswith("bf16") else dtype).to(dtype) for p in parts)
    joined = torch.cat(parts, dim=1)
    assert tensor_digest("w", ColumnPieces(parts)) == tensor_digest("w", joined)
    assert tensor_digest("w", ColumnPieces(parts), scheme="w1") == tensor_digest("w", joined, scheme="w1")
    swapped = ColumnPieces(parts[::-1])  # the blocks' order is the columns' order
    assert tensor_digest("w", swapped) != tensor_digest("w", joined)
    if values == "bf16":  # bf16 numbers stored as float32 give the same digest
        as_f32 = tuple(p.float() for p in parts)
        assert tensor_digest("w", ColumnPieces(as_f32)) == tensor_digest("w", joined)


def test_row_pieces_cut_leading_rows_across_parts() -> None:
    a, b = torch.arange(6.0).view(3, 2), torch.arange(6.0, 14.0).view(4, 2)
    pieces = RowPieces((a, b))
    assert pieces.shape == (7, 2) and pieces.dtype == torch.float32
    assert torch.equal(torch.cat(pieces[:5].parts), torch.cat([a, b])[:5])
    assert torch.equal(torch.cat(pieces[:3].parts), a) and pieces[:7].shape == (7, 2)
    with pytest.raises(ValueError, match="leading row count"):
        pieces[1:3]


def test_a_legacy_reader_is_a_row_piece_source_and_a_dict_is_not(tmp_path: Path) -> None:
    full = _weights(torch.float32, bf16_values=False)
    spec = ModelSpec(kind="gpt", cfg=CFG)
    write_layout(DictSource(spec, full), tmp_path / "ckpt", ParallelConfig(tp=2, pp=1),
                 options=WriteOptions(iteration="release"))  # fmt: skip
    assert isinstance(open_checkpoint(tmp_path / "ckpt"), RowPieceSource)
    assert not isinstance(DictSource(spec, full), RowPieceSource)


def test_a_digest_that_raises_still_releases_its_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pieces' pages are given back whether their digest succeeds or fails, and the failure reaches
    the caller (a reader's mapped pages are never left resident by an error)."""
    released: list[str] = []

    def boom(name: str, tensor: object, *, scheme: str) -> bytes:
        raise RuntimeError(f"digest of {name} failed")

    monkeypatch.setattr(fingerprint, "tensor_digest", boom)
    rows = RowPieces((torch.ones(2, 3), torch.zeros(1, 3)), release=lambda: released.append("rows"))
    columns = ColumnPieces((torch.ones(2, 3), torch.zeros(2, 1)), release=lambda: released.append("columns"))
    for name, pieces in (("w", rows), ("v", columns)):
        with pytest.raises(RuntimeError, match=f"digest of {name} failed"):
            fingerprint.tensor_digests([(name, pieces)], workers=2)
    assert released == ["rows", "columns"]
