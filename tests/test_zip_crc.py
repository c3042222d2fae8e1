"""CRC-32s filled in after torch's zip writer skipped them give torch's own bytes.

The checks are Python's ``zipfile`` (an independent reader: ``testzip`` recomputes every CRC)
and ``torch.save`` (the bytes with torch computing the CRCs itself).
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from pathlib import Path
from typing import IO

import pytest
import torch

from pretrain.checkpoint.legacy.stream_save import LazyTensor, stream_save
from pretrain.checkpoint.torch_dist.distcp_writer import file_count
from pretrain.checkpoint.types import RowPieces
from pretrain.checkpoint.zip_crc import crc32, fill_crc32, zip_records
from tests.dcp_reference import dcp_save


def _state() -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    model = {"embedding.weight": torch.randn(33, 8, generator=gen).bfloat16(),
             "layers.0.weight": torch.randn(8, 8, generator=gen), "empty": torch.zeros(0),
             "flag": torch.tensor([True, False])}  # fmt: skip
    return {"iteration": 3, "model": model, "optimizer": {"m": torch.randn(5, generator=gen), "step": 2}}


def _lazy(state: dict[str, object]) -> dict[str, object]:
    model = state["model"]
    assert isinstance(model, dict)
    return {**state, "model": {k: LazyTensor(v.dtype, tuple(v.shape), v.clone) for k, v in model.items()}}


def test_crc32_is_zlibs() -> None:
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert crc32(data.numpy()) == zlib.crc32(data.numpy().tobytes())
    assert crc32(b"") == 0 and crc32(b"b", crc32(b"a")) == zlib.crc32(b"ab")


def test_stream_save_into_a_file_is_torch_save_with_its_crcs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same bytes as ``torch.save`` into a file object; torch's writer was asked not to
    compute CRCs, and zipfile verifies every record."""
    state = _state()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with open(tmp_path / "a" / "model.pt", "wb") as out:
        torch.save(state, out)
    asked: list[bool] = []
    writer = torch._C.PyTorchFileWriter

    def spy(fh: IO[bytes], compute_crc32: bool = True, storage_alignment: int = 64) -> object:
        asked.append(compute_crc32)
        return writer(fh, compute_crc32, storage_alignment)

    monkeypatch.setattr(torch._C, "PyTorchFileWriter", spy)
    with open(tmp_path / "b" / "model.pt", "w+b") as fh:
        stream_save(_lazy(state), fh)
    assert asked == [False]
    got, want = (tmp_path / "b" / "model.pt").read_bytes(), (tmp_path / "a" / "model.pt").read_bytes()
    assert got == want
    with zipfile.ZipFile(tmp_path / "b" / "model.pt") as zf:
        assert zf.testzip() is None


def test_pieces_and_column_ranges_are_gathered_into_their_records(tmp_path: Path) -> None:
    """A shard given as row pieces, or as a column range of a block (rows apart in memory), is
    written into its record where it lies (torch writes the header and leaves room; the rows go
    into it): the bytes of ``torch.save`` of the joined tensors, every CRC right."""
    gen = torch.Generator().manual_seed(2)
    block = torch.randn(40, 24, generator=gen).bfloat16()
    made: dict[str, torch.Tensor | RowPieces] = {
        "columns": block[:, 8:20],  # a row-parallel shard of a stored block
        "pieces": RowPieces((block[:7], block[30:], block[10:11])),  # SwiGLU halves, GQA groups
        "whole": block,
        "one_row": block[3:4, 2:5],
        "empty": block[:0, :4],
    }
    # each its own storage with row-major strides, as the shards' records are (a view would share
    # the block's storage in torch.save; a clone keeps a size-1 axis's stride)
    joined = {
        k: torch.cat(v.parts) if isinstance(v, RowPieces) else v.new_empty(v.shape).copy_(v)
        for k, v in made.items()
    }
    with open(tmp_path / "want.pt", "wb") as out:
        torch.save(joined, out)
    lazy = {k: LazyTensor(v.dtype, tuple(v.shape), lambda v=v: v) for k, v in made.items()}  # type: ignore[misc]
    with open(tmp_path / "got.pt", "w+b") as fh:
        stream_save(lazy, fh)
    assert (tmp_path / "got.pt").read_bytes() == (tmp_path / "want.pt").read_bytes()
    with zipfile.ZipFile(tmp_path / "got.pt") as zf:
        assert zf.testzip() is None


def test_column_blocks_and_stacked_chunks_are_gathered_after_other_archives(tmp_path: Path) -> None:
    """A tensor given as column blocks (a row-parallel linear's TP shards), announced with leading
    size-1 axes (a ``torch_dist`` chunk of a stacked tensor), written after other bytes in the same
    file (dcp's archives back to back): from that offset on, the bytes of ``torch.save`` of the
    joined tensor, every CRC right. A made tensor of another shape is refused."""
    from pretrain.checkpoint.types import ColumnPieces

    gen = torch.Generator().manual_seed(3)
    blocks = ColumnPieces(
        (torch.randn(9, 5, generator=gen).bfloat16(), torch.randn(9, 7, generator=gen).bfloat16())
    )
    joined = torch.cat(blocks.parts, dim=1).reshape(1, 1, 9, 12)
    want = io.BytesIO()
    torch.save(joined, want)
    prefix = b"an earlier archive" * 7
    with open(tmp_path / "got", "w+b") as fh:
        fh.write(prefix)
        stream_save(LazyTensor(torch.bfloat16, (1, 1, 9, 12), lambda: blocks), fh)
    got = (tmp_path / "got").read_bytes()
    assert got[: len(prefix)] == prefix and got[len(prefix) :] == want.getvalue()
    with zipfile.ZipFile(io.BytesIO(got[len(prefix) :])) as zf:
        assert zf.testzip() is None
    with open(tmp_path / "bad", "w+b") as fh, pytest.raises(RuntimeError, match="announced as"):
        stream_save(LazyTensor(torch.bfloat16, (2, 9, 6), lambda: blocks), fh)


def test_without_header_only_records_the_pieces_are_joined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch < 2.5's zip writer has no ``write_record_metadata``: the same bytes, joined first."""

    class OldWriter:  # torch's writer without the header-only record
        def __init__(self, *args: object) -> None:
            self._zf = real(*args)  # type: ignore[call-overload]

        def __getattr__(self, name: str) -> object:
            if name == "write_record_metadata":
                raise AttributeError(name)
            return getattr(self._zf, name)

    block = torch.randn(12, 10, generator=torch.Generator().manual_seed(3)).bfloat16()
    made: dict[str, torch.Tensor | RowPieces] = {
        "columns": block[:, 2:7],
        "pieces": RowPieces((block[:3], block[8:])),
    }
    lazy = {k: LazyTensor(v.dtype, tuple(v.shape), lambda v=v: v) for k, v in made.items()}  # type: ignore[misc]
    with open(tmp_path / "new.pt", "w+b") as fh:
        stream_save(lazy, fh)
    real = torch._C.PyTorchFileWriter
    monkeypatch.setattr(torch._C, "PyTorchFileWriter", OldWriter)
    with open(tmp_path / "old.pt", "w+b") as fh:
        stream_save(lazy, fh)
    assert (tmp_path / "old.pt").read_bytes() == (tmp_path / "new.pt").read_bytes()
    with zipfile.ZipFile(tmp_path / "old.pt") as zf:
        assert zf.testzip() is None


def test_a_write_only_target_keeps_torchs_crcs(tmp_path: Path) -> None:
    state = _state()
    want = io.BytesIO()
    torch.save(state, want)
    got = io.BytesIO()
    stream_save(_lazy(state), got)
    assert got.getvalue() == want.getvalue()
    with open(tmp_path / "w.pt", "wb") as fh:
        stream_save(_lazy(state), fh)
    with zipfile.ZipFile(tmp_path / "w.pt") as zf:
        assert zf.testzip() is None


def _zero_crcs(path: Path, start: int = 0, end: int | None = None) -> None:
    with open(path, "r+b") as fh:
        for rec in zip_records(fh.fileno(), start, end):
            for at in (rec.local_crc_at, rec.central_crc_at):
                fh.seek(at)
                fh.write(b"\0\0\0\0")


def test_zip64_archives_and_an_archive_inside_a_larger_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """zipfile writes zip64 records once offsets pass ZIP64_LIMIT (lowered here, so a small
    archive has zip64 offsets, sizes and end records); the archive sits after a prefix and
    before a suffix, as a tensor's archive inside a ``.distcp`` file."""
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 300)
    payloads = {f"archive/data/{i}": bytes(range(i, 256)) * (i + 2) for i in range(5)}
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in payloads.items():
            zf.writestr(name, data)
    archive = inner.getvalue()
    assert struct.pack("<I", 0x06064B50) in archive  # a zip64 end record was written
    prefix, suffix = b"p" * 1000, b"s" * 77
    path = tmp_path / "x.distcp"
    path.write_bytes(prefix + archive + suffix)
    span = (len(prefix), len(prefix) + len(archive))
    _zero_crcs(path, *span)
    assert path.read_bytes() != prefix + archive + suffix
    with open(path, "r+b") as fh:
        recs = zip_records(fh.fileno(), *span)
        assert [r.name for r in recs] == [n.split("/", 1)[1] for n in payloads]
        assert [r.size for r in recs] == [len(d) for d in payloads.values()]
        fill_crc32(fh, {"data/1": zlib.crc32(payloads["archive/data/1"])}, start=span[0], end=span[1])
    assert path.read_bytes() == prefix + archive + suffix


def test_not_a_zip_archive_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk"
    path.write_bytes(b"x" * 100)
    with open(path, "r+b") as fh, pytest.raises(ValueError, match="end-of-central-directory"):
        fill_crc32(fh)


def test_torch_dist_files_are_the_bytes_of_a_save_with_crcs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``write_torch_dist`` saves with torch's CRCs off and fills them in: every archive in the
    ``.distcp`` file verifies in zipfile, and the file equals dcp's own ``FileSystemWriter``'s,
    with torch computing the CRCs."""
    import torch.distributed.checkpoint as dcp

    import pretrain.checkpoint.torch_dist.writer as writer
    from pretrain.checkpoint.plan import ModelSpec
    from pretrain.checkpoint.types import DictSource
    from pretrain.parallel.config import ParallelConfig
    from tests.gpt_fixtures import full_weights, tiny_config

    cfg = tiny_config(num_layers=2, params_dtype="bfloat16")
    source = DictSource(
        ModelSpec(kind="gpt", cfg=cfg), {k: v.bfloat16() for k, v in full_weights(cfg).items()}
    )
    writer.write_torch_dist(source, tmp_path / "filled", ParallelConfig(tp=2, pp=1))
    # dcp's own FileSystemWriter, torch computing the CRCs itself
    dcp_save(source, tmp_path / "torch" / "release", ParallelConfig(tp=2, pp=1), thread_count=file_count())
    names = [f"__0_{i}.distcp" for i in range(file_count())]
    assert sorted(p.name for p in (tmp_path / "filled" / "release").glob("*.distcp")) == names
    for name in names:
        filled, by_torch = (tmp_path / d / "release" / name for d in ("filled", "torch"))
        assert filled.read_bytes() == by_torch.read_bytes(), name
    metadata = dcp.FileSystemReader(str(tmp_path / "filled" / "release")).read_metadata()
    archives = 0
    for info in metadata.storage_data.values():
        data = (tmp_path / "filled" / "release" / info.relative_path).read_bytes()
        chunk = data[info.offset : info.offset + info.length]
        if chunk.startswith(b"PK\x03\x04"):
            with zipfile.ZipFile(io.BytesIO(chunk)) as zf:
                assert zf.testzip() is None
            archives += 1
    assert archives == len(metadata.storage_data) > 10


@pytest.mark.parametrize("at", [0, 4096, 12345])
def test_crc_of_a_large_file_range_is_read_through_a_mapping(tmp_path: Path, at: int) -> None:
    from pretrain.checkpoint.zip_crc import crc_of_file_range

    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    raw = data.numpy().tobytes()
    path = tmp_path / "f"
    path.write_bytes(b"x" * at + raw + b"tail")
    with open(path, "rb") as fh:
        assert crc_of_file_range(fh.fileno(), at, len(raw)) == zlib.crc32(raw)
        assert crc_of_file_range(fh.fileno(), at + 5, 100) == zlib.crc32(raw[5:105])


def test_torch_dist_writer_keeps_no_chunk_after_writing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory of a ``torch_dist`` save is one batch of chunks (one per file) being written and the
    next batch being made: when the writer asks for a chunk, every chunk it asked for before has
    been freed but those (and the pipeline keeps their bytes within the largest batch's:
    ``tests/test_write_pipeline.py``). (dcp's own ``FileSystemWriter`` keeps each key's last
    chunk until the file ends: the same probe sees them there.)"""
    import weakref

    import pretrain.checkpoint.torch_dist.writer as writer
    from pretrain.checkpoint.plan import ModelSpec
    from pretrain.checkpoint.types import DictSource
    from pretrain.parallel.config import ParallelConfig
    from tests.gpt_fixtures import full_weights, tiny_config

    cfg = tiny_config(num_layers=3, params_dtype="bfloat16")
    source = DictSource(
        ModelSpec(kind="gpt", cfg=cfg), {k: v.bfloat16() for k, v in full_weights(cfg).items()}
    )
    resolve = writer._ChunkMaker.data

    def most_alive_before_each_chunk(save: Path) -> int:
        made: list[weakref.ref] = []
        most = 0

        def probed(self, item):  # noqa: ANN001, ANN202
            nonlocal most
            data = resolve(self, item)
            if not isinstance(data, torch.Tensor):
                return data
            most = max(most, sum(w() is not None for w in made))
            data = data.clone()  # a storage only the writer holds
            made.append(weakref.ref(data.untyped_storage()))
            return data

        with monkeypatch.context() as m:
            m.setattr(writer._ChunkMaker, "data", probed)
            if save.name == "ours":
                writer.write_torch_dist(source, save, ParallelConfig(tp=1, pp=1))
            else:  # the same plan through dcp.save and its FileSystemWriter
                dcp_save(source, save / "release", ParallelConfig(tp=1, pp=1), thread_count=file_count())
        return most

    # one batch (a chunk per file) being written and the next one being made: the others are gone
    assert most_alive_before_each_chunk(tmp_path / "ours") <= 2 * file_count() - 1
    assert most_alive_before_each_chunk(tmp_path / "torch") > 5


def test_files_in_lockstep_are_written_by_several_threads_with_one_threads_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stream_save_all`` makes record ``k`` of every file here, then writes them on up to one
    thread per CPU: each file is still ``torch.save``'s bytes, and the writes did run apart."""
    import threading

    import pretrain.checkpoint.legacy.stream_save as ss

    monkeypatch.setattr(ss.os, "cpu_count", lambda: 4)
    gen = torch.Generator().manual_seed(4)
    states = [{"a": torch.randn(64, 32, generator=gen), "b": torch.randn(300, generator=gen).bfloat16()}
              for _ in range(3)]  # fmt: skip
    threads: set[str] = set()
    real = ss._Archive.write_gathered
    together = threading.Barrier(3, timeout=60)  # each record's three writes run at once (or this fails)

    def noted(self, name, chunks, nbytes):  # noqa: ANN001, ANN202
        threads.add(threading.current_thread().name)
        together.wait()
        return real(self, name, chunks, nbytes)

    monkeypatch.setattr(ss._Archive, "write_gathered", noted)
    lazy = [
        {k: LazyTensor(v.dtype, tuple(v.shape), lambda v=v: RowPieces((v[:1], v[1:]))) for k, v in s.items()}  # type: ignore[misc]
        for s in states
    ]
    paths = [tmp_path / f"got{i}.pt" for i in range(3)]
    handles = [open(p, "w+b") for p in paths]  # noqa: SIM115
    try:
        ss.stream_save_all(list(zip(lazy, handles, strict=True)))
    finally:
        for fh in handles:
            fh.close()
    assert len(threads) == 3 and all(t.startswith("stream_save") for t in threads)
    for state, path in zip(states, paths, strict=True):
        want = io.BytesIO()
        torch.save(state, want)
        assert path.read_bytes() == want.getvalue()
