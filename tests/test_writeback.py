"""Writers start the disk writeback of every range they write (``sync_file_range``), so a file's
final fsync waits for less: each large write queues exactly its own bytes, small ones are left to
the fsync, and the written bytes are what they were."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.legacy import stream_save as stream_save_module
from pretrain.utils import gathered_write, writeback
from pretrain.utils.gathered_write import column_chunks, flat_bytes, write_gathered

MB = 1 << 20


@pytest.fixture
def queued(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The (offset, bytes) ranges ``write_gathered`` hands to ``start_writeback``."""
    calls: list[tuple[int, int]] = []

    def record(fd: int, offset: int, nbytes: int) -> bool:
        calls.append((offset, nbytes))
        return True

    monkeypatch.setattr(gathered_write, "start_writeback", record)
    monkeypatch.setattr(stream_save_module, "start_writeback", record)
    return calls


def _chunks(sizes: list[int]) -> list[memoryview]:
    return [memoryview(bytes([i % 251]) * n) for i, n in enumerate(sizes)]


def test_a_write_at_an_offset_queues_its_own_range(tmp_path: Path, queued: list[tuple[int, int]]) -> None:
    chunks = _chunks([MB, MB // 2, 3])
    with open(tmp_path / "f", "wb") as fh:
        fh.write(b"h" * 100)
        fh.flush()
        write_gathered(fh.fileno(), chunks, 100, writeback=True)
    assert queued == [(100, MB + MB // 2 + 3)]
    assert (tmp_path / "f").read_bytes() == b"h" * 100 + b"".join(bytes(c) for c in chunks)


def test_a_write_at_the_file_position_queues_from_that_position(
    tmp_path: Path, queued: list[tuple[int, int]]
) -> None:
    chunks = _chunks([2 * MB, 5])
    with open(tmp_path / "f", "wb") as fh:
        fh.write(b"h" * 7)
        fh.flush()
        write_gathered(fh.fileno(), chunks, writeback=True)
        write_gathered(fh.fileno(), _chunks([10]), writeback=True)  # small: no position asked, nothing queued
    assert queued == [(7, 2 * MB + 5)]
    assert (tmp_path / "f").stat().st_size == 7 + 2 * MB + 5 + 10


def test_staged_column_rows_queue_each_staged_block(
    tmp_path: Path, queued: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gathered_write, "_STAGE_BYTES", MB)
    parts = [torch.arange(600 * 100, dtype=torch.float32).view(600, 100), torch.ones(600, 900)]
    with open(tmp_path / "f", "wb") as fh:
        write_gathered(fh.fileno(), column_chunks(parts), 0, writeback=True)
    total = 600 * 1000 * 4
    assert sum(n for _, n in queued) == total
    assert [off for off, _ in queued] == [sum(n for _, n in queued[:i]) for i in range(len(queued))]
    assert (tmp_path / "f").read_bytes() == bytes(flat_bytes(torch.cat(parts, dim=1)))


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


def test_a_pipe_is_written_with_nothing_queued(queued: list[tuple[int, int]]) -> None:
    """A descriptor without a position (a pipe) is written as before; there is no range to queue."""
    read_end, write_end = os.pipe()
    try:
        payload = _chunks([MB + 1])
        reader = os.fdopen(read_end, "rb")

        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(reader.read()))
        t.start()
        write_gathered(write_end, payload, writeback=True)
        os.close(write_end)
        t.join()
        reader.close()
    finally:
        with contextlib.suppress(OSError):
            os.close(write_end)
    assert got == [bytes(payload[0])] and queued == []


def test_files_not_fsynced_are_left_to_the_kernel(tmp_path: Path, queued: list[tuple[int, int]]) -> None:
    """Without ``writeback`` (an HF export's safetensors: never fsynced) nothing is queued."""
    with open(tmp_path / "f", "wb") as fh:
        write_gathered(fh.fileno(), _chunks([2 * MB]))
        write_gathered(fh.fileno(), _chunks([2 * MB]), 0)
    assert queued == []


def test_stream_save_queues_each_large_record_of_its_archive(
    tmp_path: Path, queued: list[tuple[int, int]]
) -> None:
    """A legacy rank file (fsynced by ``atomic_open``) queues every record of a MB or more, made
    whole (torch's record writer) or gathered from pieces, over the bytes of that record; a
    stream that is not a real file queues nothing."""
    from pretrain.checkpoint.legacy.stream_save import LazyTensor, stream_save
    from pretrain.checkpoint.types import RowPieces

    whole = torch.arange(MB // 2, dtype=torch.float32)  # 2 MB
    pieces = RowPieces((torch.ones(MB // 4), torch.zeros(MB // 4)))  # 2 MB in two blocks
    obj = {"model": {"a": LazyTensor(torch.float32, (MB // 2,), lambda: whole),
                     "p": LazyTensor(torch.float32, (MB // 2,), lambda: pieces), "b": torch.ones(10)}}  # fmt: skip
    with open(tmp_path / "f.pt", "w+b") as fh:
        stream_save(obj, fh)
    data = (tmp_path / "f.pt").read_bytes()
    assert len(queued) == 2
    for (offset, n), expected in zip(queued, (whole, torch.cat(pieces.parts)), strict=True):
        assert n >= 2 * MB and bytes(flat_bytes(expected)) in data[offset : offset + n]
    loaded = torch.load(tmp_path / "f.pt", weights_only=True)["model"]
    assert torch.equal(loaded["a"], whole) and torch.equal(loaded["p"], torch.cat(pieces.parts))
    queued.clear()
    stream_save(obj, io.BytesIO())
    assert queued == []
