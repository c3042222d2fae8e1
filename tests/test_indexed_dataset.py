"""Megatron-compatible indexed datasets: byte layout, round trips per dtype, corruption, atomicity, merging."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from pretrain.data.indexed_dataset import (
    DTYPE_CODES,
    INDEX_MAGIC,
    IndexedDataset,
    optimal_dtype,
)
from pretrain.data.indexed_dataset_builder import IndexedDatasetBuilder, merge_datasets
from pretrain.utils.errors import UserError


def _random_documents(rng: np.random.Generator, dtype: np.dtype, n_docs: int = 30) -> list[list[np.ndarray]]:
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        lo, hi = int(info.min), int(info.max)
        make = lambda n: rng.integers(lo, hi, size=n, endpoint=True).astype(dtype)  # noqa: E731
    else:
        make = lambda n: rng.standard_normal(n).astype(dtype)  # noqa: E731
    docs = []
    for d in range(n_docs):
        n_seq = 0 if d == 3 else int(rng.integers(1, 4))  # document 3 is empty
        docs.append([make(int(rng.integers(0, 40))) for _ in range(n_seq)])
    return docs


def _write(prefix: Path, docs: list[list[np.ndarray]], dtype: np.dtype) -> None:
    with IndexedDatasetBuilder(prefix, dtype=dtype) as builder:
        for doc in docs:
            for seq in doc:
                builder.add_item(seq)
            builder.end_document()


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype(tmp_path: Path, code: int) -> None:
    dtype = np.dtype(DTYPE_CODES[code])
    docs = _random_documents(np.random.default_rng(code), dtype)
    prefix = tmp_path / "data"
    _write(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    seqs = [s for doc in docs for s in doc]
    assert ds.dtype == dtype
    assert len(ds) == len(seqs)
    assert ds.num_documents == len(docs)
    assert ds.sequence_lengths.tolist() == [len(s) for s in seqs]
    assert ds.document_indices.tolist() == [0, *np.cumsum([len(d) for d in docs]).tolist()]
    for i, seq in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], seq)
        assert ds[i].dtype == dtype
    for d, doc in enumerate(docs):
        np.testing.assert_array_equal(ds.get_document(d), np.concatenate(doc) if doc else np.zeros(0, dtype))
    long = max(range(len(seqs)), key=lambda i: len(seqs[i]))
    np.testing.assert_array_equal(ds.get(long, 2, 5), seqs[long][2:7])
    np.testing.assert_array_equal(ds.get(long, 3), seqs[long][3:])
    assert [x.tolist() for x in ds[1:4]] == [s.tolist() for s in seqs[1:4]]
    np.testing.assert_array_equal(ds[-1], seqs[-1])
    with pytest.raises(IndexError):
        ds[len(seqs)]
    with pytest.raises(IndexError):
        ds.get(long, 0, len(seqs[long]) + 1)
    # Pickling reopens the files rather than copying the memory maps.
    clone = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(clone[long], seqs[long])


def test_byte_layout_matches_megatron(tmp_path: Path) -> None:
    prefix = tmp_path / "tiny"
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as builder:
        builder.add_document([1, 2, 3])
        builder.add_document([4, 5, 6, 7, 8], lengths=[2, 3])
    expected = (
        INDEX_MAGIC
        + struct.pack("<Q", 1)
        + struct.pack("<B", 8)  # uint16
        + struct.pack("<Q", 3)  # sequences
        + struct.pack("<Q", 3)  # len(document_indices)
        + np.array([3, 2, 3], "<i4").tobytes()
        + np.array([0, 6, 10], "<i8").tobytes()
        + np.array([0, 1, 3], "<i8").tobytes()
    )
    assert (tmp_path / "tiny.idx").read_bytes() == expected
    assert (tmp_path / "tiny.bin").read_bytes() == np.arange(1, 9, dtype="<u2").tobytes()
    ds = IndexedDataset(prefix)
    assert ds.document_lengths.tolist() == [3, 5]
    assert ds.document_offsets.tolist() == [0, 3]
    np.testing.assert_array_equal(ds.read(2, 4), [3, 4, 5, 6])


def test_optimal_dtype() -> None:
    assert optimal_dtype(1024) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(50257) == np.uint16
    assert optimal_dtype(None) == np.int32


def test_out_of_range_token_is_refused(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(tmp_path / "x", dtype=np.uint16)
    with pytest.raises(ValueError, match="do not fit in uint16"):
        builder.add_item([1, 70000])
    with pytest.raises(ValueError, match="do not fit in uint16"):
        builder.add_item([-1])
    builder.abort()
    assert list(tmp_path.iterdir()) == []


def _good(tmp_path: Path) -> Path:
    prefix = tmp_path / "good"
    _write(prefix, _random_documents(np.random.default_rng(0), np.dtype(np.int32), 10), np.dtype(np.int32))
    return prefix


def _corrupt(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("damage", "pattern"),
    [
        (
            lambda p: _corrupt(p.with_suffix(".idx"), 0, b"NOTMAGIC!"),
            r"good\.idx: not a Megatron MMIDIDX index",
        ),
        (lambda p: p.with_suffix(".idx").write_bytes(b"MMID"), r"good\.idx: truncated index"),
        (lambda p: p.with_suffix(".idx").write_bytes(b""), r"good\.idx: truncated index"),
        (
            lambda p: _corrupt(p.with_suffix(".idx"), 9, struct.pack("<Q", 2)),
            r"good\.idx: unsupported index version 2",
        ),
        (lambda p: _corrupt(p.with_suffix(".idx"), 17, bytes([9])), r"good\.idx: unknown dtype code 9"),
        (
            lambda p: p.with_suffix(".idx").write_bytes(p.with_suffix(".idx").read_bytes()[:-5]),
            r"good\.idx: truncated index",
        ),
        (
            lambda p: p.with_suffix(".idx").write_bytes(p.with_suffix(".idx").read_bytes() + b"xx"),
            r"good\.idx: 2 unexpected trailing bytes",
        ),
        (
            lambda p: p.with_suffix(".bin").write_bytes(p.with_suffix(".bin").read_bytes()[:-4]),
            r"good\.bin: truncated data file",
        ),
        (
            lambda p: p.with_suffix(".bin").write_bytes(p.with_suffix(".bin").read_bytes() + b"\0" * 4),
            r"good\.bin: 4 bytes more than",
        ),
        (lambda p: _corrupt(p.with_suffix(".idx"), 34, struct.pack("<i", -3)), r"good\.idx: corrupt index"),
        (
            lambda p: p.with_suffix(".bin").unlink(),
            r"good\.bin: indexed dataset data \(\.bin\) file not found",
        ),
        (
            lambda p: p.with_suffix(".idx").unlink(),
            r"good\.idx: indexed dataset index \(\.idx\) file not found",
        ),
    ],
)
def test_corrupt_files_give_clear_errors(tmp_path: Path, damage, pattern: str) -> None:  # type: ignore[no-untyped-def]
    prefix = _good(tmp_path)
    IndexedDataset(prefix)  # intact
    damage(prefix)
    with pytest.raises(UserError, match=pattern):
        IndexedDataset(prefix)


def test_corrupt_pointer_is_detected(tmp_path: Path) -> None:
    prefix = _good(tmp_path)
    n_seq = len(IndexedDataset(prefix))
    _corrupt(prefix.with_suffix(".idx"), 34 + 4 * n_seq + 8, struct.pack("<q", 12345))
    with pytest.raises(UserError, match=r"good\.idx: corrupt index \(sequence 1 points at byte 12345"):
        IndexedDataset(prefix)


def test_builder_is_atomic(tmp_path: Path) -> None:
    prefix = tmp_path / "ds"
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as builder:
        builder.add_document([1, 2, 3])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["ds.bin", "ds.idx"]
    # A failure while writing leaves the previous dataset untouched and no temporaries.
    with pytest.raises(RuntimeError, match="boom"), IndexedDatasetBuilder(prefix, dtype=np.uint16) as builder:
        builder.add_document([7, 8, 9, 10])
        assert {p.name for p in tmp_path.iterdir()} != set(before)  # temporaries exist meanwhile
        raise RuntimeError("boom")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # close() writes everything under temporary names; only commit() renames.
    builder = IndexedDatasetBuilder(prefix, dtype=np.uint16)
    builder.add_document([4, 5])
    builder.close()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.startswith(".")} == before
    builder.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.idx"]
    assert IndexedDataset(prefix)[0].tolist() == [4, 5]
    assert oct(os.stat(tmp_path / "ds.bin").st_mode & 0o777) != oct(0o600)


def test_trailing_sequences_form_a_last_document(tmp_path: Path) -> None:
    with IndexedDatasetBuilder(tmp_path / "t", dtype=np.int32) as builder:
        builder.add_document([1])
        builder.add_item([2, 3])
        builder.add_item([4])
    ds = IndexedDataset(tmp_path / "t")
    assert ds.document_indices.tolist() == [0, 1, 3]


def test_merge(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    dtype = np.dtype(np.uint16)
    parts = [_random_documents(rng, dtype, n) for n in (4, 7, 1)]
    prefixes = []
    for i, docs in enumerate(parts):
        prefixes.append(tmp_path / f"part{i}")
        _write(prefixes[-1], docs, dtype)
    merged = merge_datasets(prefixes, tmp_path / "merged")
    all_docs = [doc for docs in parts for doc in docs]
    assert merged.num_documents == len(all_docs)
    for d, doc in enumerate(all_docs):
        np.testing.assert_array_equal(
            merged.get_document(d), np.concatenate(doc) if doc else np.zeros(0, dtype)
        )
    other = tmp_path / "other"
    _write(other, [[np.array([1, 2], np.int32)]], np.dtype(np.int32))
    with pytest.raises(UserError, match=r"other\.idx: dtype int32 differs from uint16"):
        merge_datasets([prefixes[0], other], tmp_path / "bad")
    assert not (tmp_path / "bad.bin").exists() and not (tmp_path / "bad.idx").exists()


def test_empty_dataset(tmp_path: Path) -> None:
    with IndexedDatasetBuilder(tmp_path / "e", dtype=np.uint16):
        pass
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0
