"""The archives ``stream_save`` writes (legacy rank files, ``.distcp`` files: fsynced once complete)
queue the disk writeback of each record of a MB or more as soon as it is written
(``sync_file_range``), so the final fsync waits for less: each queued range is that record (its
header and its data, nothing of another), small records and streams that are not files queue
nothing, and the bytes are what they were."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.legacy import stream_save as stream_save_module
from pretrain.checkpoint.legacy.stream_save import LazyTensor, stream_save
from pretrain.checkpoint.types import ColumnPieces, RowPieces
from pretrain.utils import gathered_write, writeback
from pretrain.utils.gathered_write import flat_bytes

MB = 1 << 20
HEADER_MAX = 200  # a record's local header, its name and torch's alignment padding


@pytest.fixture
def queued(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The (offset, bytes) ranges the archive hands to ``start_writeback``."""
    calls: list[tuple[int, int]] = []

    def record(fd: int, offset: int, nbytes: int) -> bool:
        calls.append((offset, nbytes))
        return True

    monkeypatch.setattr(stream_save_module, "start_writeback", record)
    return calls


def _lazy(
    made: torch.Tensor | RowPieces | ColumnPieces, dtype: torch.dtype, shape: tuple[int, ...]
) -> LazyTensor:
    return LazyTensor(dtype, shape, lambda: made)


def test_each_large_record_queues_its_own_bytes(tmp_path: Path, queued: list[tuple[int, int]]) -> None:
    """A record made whole (torch's record writer) and one gathered from row blocks are queued,
    each over its header and data only, in file order; the small one is left to the fsync."""
    whole = torch.arange(MB // 2, dtype=torch.float32)  # 2 MB
    rows = RowPieces((torch.ones(MB // 4), torch.full((MB // 4,), 2.0)))  # 2 MB in two blocks
    obj = {"model": {"a": _lazy(whole, torch.float32, (MB // 2,)), "p": _lazy(rows, torch.float32, (MB // 2,)),
                     "b": torch.ones(10)}}  # fmt: skip
    with open(tmp_path / "f.pt", "w+b") as fh:
        stream_save(obj, fh)
    data = (tmp_path / "f.pt").read_bytes()
    assert len(queued) == 2 and queued[0][0] + queued[0][1] <= queued[1][0]
    for (offset, n), expected in zip(queued, (whole, torch.cat(rows.parts)), strict=True):
        assert 2 * MB < n <= 2 * MB + HEADER_MAX
        record = data[offset : offset + n]  # its local header, then its data (then a data descriptor)
        assert record.startswith(b"PK\x03\x04") and bytes(flat_bytes(expected)) in record
    loaded = torch.load(tmp_path / "f.pt", weights_only=True)["model"]
    assert torch.equal(loaded["a"], whole) and torch.equal(loaded["p"], torch.cat(rows.parts))


def test_a_staged_column_record_is_queued_once_whole(
    tmp_path: Path, queued: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short rows of column blocks go through the staging buffer in several steps; the record is
    queued once, over all of it."""
    monkeypatch.setattr(gathered_write, "_STAGE_BYTES", MB)
    parts = (torch.arange(600 * 100, dtype=torch.float32).view(600, 100), torch.ones(600, 900))
    obj = {"w": _lazy(ColumnPieces(parts), torch.float32, (600, 1000))}
    with open(tmp_path / "f.pt", "w+b") as fh:
        stream_save(obj, fh)
    [(offset, n)] = queued
    joined = torch.cat(parts, dim=1)
    assert 600 * 1000 * 4 < n <= 600 * 1000 * 4 + HEADER_MAX
    record = (tmp_path / "f.pt").read_bytes()[offset : offset + n]
    assert record.startswith(b"PK\x03\x04") and record.endswith(bytes(flat_bytes(joined)))
    assert torch.equal(torch.load(tmp_path / "f.pt", weights_only=True)["w"], joined)


def test_a_stream_that_is_not_a_file_queues_nothing(queued: list[tuple[int, int]]) -> None:
    big = torch.zeros(MB // 2)
    buf = io.BytesIO()
    stream_save({"a": _lazy(big, torch.float32, (MB // 2,))}, buf)
    assert queued == [] and torch.equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["a"], big)


def test_start_writeback_queues_long_ranges_of_a_real_file_and_skips_short_ones(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x" * (2 * MB))
        assert not writeback.start_writeback(fd, 0, writeback.MIN_BYTES - 1)
        queued = writeback.start_writeback(fd, 0, 2 * MB)
        if sys.platform.startswith("linux"):  # ext4, xfs, btrfs, tmpfs and overlayfs accept it
            assert queued
        os.fsync(fd)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"x" * (2 * MB)


def test_it_can_be_switched_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writeback, "_ENABLED", False)
    with open(tmp_path / "f", "wb") as fh:
        fh.write(b"x" * (2 * MB))
        fh.flush()
        assert not writeback.start_writeback(fh.fileno(), 0, 2 * MB)
