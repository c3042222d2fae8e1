"""Megatron-compatible memory-mapped indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``).

``PREFIX.bin`` holds the raw tokens of every sequence, back to back, in one numeric dtype.
``PREFIX.idx`` (all little-endian) is Megatron's ``MMIDIDX`` index, version 1::

    b"MMIDIDX\\x00\\x00"        9-byte magic
    <Q  version              1
    <B  dtype code           1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    <Q  sequence count       N
    <Q  document count       D + 1 (the length of the document index array below)
    int32[N]   sequence lengths (in elements)
    int64[N]   sequence pointers (byte offset of each sequence in .bin)
    int64[D+1] document indices: document d holds sequences [doc[d], doc[d+1]); doc[0] = 0, doc[D] = N

A sequence is one unit of tokens: a whole document for GPT, a sentence for BERT (``mlm-preprocess
--split-sentences``); documents group consecutive sequences. The files written here load in
Megatron-LM and vice versa.

Writing is atomic: :class:`IndexedDatasetBuilder` writes both files as hidden temporaries beside
the destination and renames them only in :meth:`~IndexedDatasetBuilder.finalize` (``.bin`` first,
then ``.idx``); an exception or :meth:`~IndexedDatasetBuilder.abort` leaves no file behind.
Token ids are written with :func:`optimal_dtype` (uint16 when the vocabulary has fewer than 65500
entries, else int32), as Megatron does.
"""

from __future__ import annotations

import array
import contextlib
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from pretrain.utils.errors import UserError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8

DTYPE_CODES: dict[int, type[np.number[Any]]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def data_file_path(prefix: str | os.PathLike[str]) -> str:
    return os.fspath(prefix) + ".bin"


def index_file_path(prefix: str | os.PathLike[str]) -> str:
    return os.fspath(prefix) + ".idx"


def dataset_exists(prefix: str | os.PathLike[str]) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def optimal_dtype(vocab_size: int | None) -> np.dtype[Any]:
    """Smallest dtype for token ids below ``vocab_size`` (Megatron's rule: uint16 below 65500)."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def dtype_code(dtype: Any) -> int:
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise ValueError(
            f"dtype {dt} cannot be stored in an indexed dataset; use one of {sorted(map(str, _CODE_OF))}"
        )
    return _CODE_OF[dt]


# --------------------------------------------------------------------------------------------- writing


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class IndexedDatasetBuilder:
    """Write ``PREFIX.bin`` / ``PREFIX.idx`` atomically.

    >>> with IndexedDatasetBuilder("out/data_text_document", dtype=np.uint16) as b:  # doctest: +SKIP
    ...     b.add_document([5, 6, 7])                    # one document of one sequence
    ...     b.add_document([1, 2, 3, 4], lengths=[2, 2])  # one document of two sentences
    ... # files appear here, on leaving the block without an exception

    Use :meth:`close` then :meth:`commit` to publish several datasets together: everything is
    written and flushed by ``close``; ``commit`` only renames.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: Any = np.int32) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self._bin_path = Path(data_file_path(self.prefix))
        self._idx_path = Path(index_file_path(self.prefix))
        self._bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = self._mktemp(self._bin_path)
        self._idx_tmp: Path | None = None
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._lengths = array.array("q")
        self._doc_indices = array.array("q", [0])
        self._state = "open"  # open -> closed -> committed | aborted
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._range: tuple[int, int] | None = (int(info.min), int(info.max))
        else:
            self._range = None

    @staticmethod
    def _mktemp(dest: Path) -> Path:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        os.close(fd)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; datasets get the usual permissions
        return Path(tmp)

    # -- adding data

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    @property
    def num_documents(self) -> int:
        return len(self._doc_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(sum(self._lengths))

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"indexed dataset builder for {self.prefix} is already {self._state}")

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence (it belongs to the current document until :meth:`end_document`)."""
        self._check_open()
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {arr.shape}")
        if arr.size and self._range is not None:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._range[0] or hi > self._range[1]:
                raise ValueError(f"token ids {lo}..{hi} do not fit in {self.dtype} (dataset {self.prefix})")
        if arr.size >= 2**31:
            raise ValueError("a sequence longer than 2**31 - 1 elements cannot be indexed")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(arr.size))

    def end_document(self) -> None:
        """Close the current document (made of the sequences added since the last one)."""
        self._check_open()
        self._doc_indices.append(len(self._lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int] | None = None) -> None:
        """Append one document: ``tokens`` split into sequences of ``lengths`` (default: one sequence)."""
        arr = np.asarray(tokens)
        if lengths is None:
            self.add_item(arr)
        else:
            if sum(int(n) for n in lengths) != arr.size:
                raise ValueError(
                    f"sequence lengths sum to {sum(lengths)} but the document has {arr.size} tokens"
                )
            start = 0
            for n in lengths:
                self.add_item(arr[start : start + int(n)])
                start += int(n)
        self.end_document()

    def add_index(self, prefix: str | os.PathLike[str]) -> None:
        """Append every document of the dataset at ``prefix`` (merging); dtypes must match."""
        self._check_open()
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise UserError(
                f"{index_file_path(prefix)}: dtype {other.dtype} differs from {self.dtype} of the merged "
                f"dataset {self.prefix}"
            )
        if self._doc_indices[-1] != len(self._lengths):
            self.end_document()  # close the document in progress
        base = len(self._lengths)
        self._lengths.frombytes(other.sequence_lengths.astype(np.int64).tobytes())
        self._doc_indices.frombytes((other.document_indices[1:].astype(np.int64) + base).tobytes())
        with open(data_file_path(prefix), "rb") as src:
            shutil.copyfileobj(src, self._bin, length=16 << 20)
        other.close()

    # -- publishing

    def close(self) -> None:
        """Flush the data and write the index, both still under temporary names."""
        self._check_open()
        if self._doc_indices[-1] != len(self._lengths):
            self.end_document()  # trailing sequences form a last document
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError("a sequence longer than 2**31 - 1 elements cannot be indexed")
        pointers = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc = np.asarray(self._doc_indices, dtype=np.int64)
        self._idx_tmp = self._mktemp(self._idx_path)
        with open(self._idx_tmp, "wb") as fh:
            fh.write(INDEX_MAGIC)
            fh.write(struct.pack("<Q", INDEX_VERSION))
            fh.write(struct.pack("<B", self._code))
            fh.write(struct.pack("<Q", lengths.size))
            fh.write(struct.pack("<Q", doc.size))
            fh.write(lengths.astype("<i4").tobytes(order="C"))
            fh.write(pointers.astype("<i8").tobytes(order="C"))
            fh.write(doc.astype("<i8").tobytes(order="C"))
            fh.flush()
            os.fsync(fh.fileno())
        self._state = "closed"

    def commit(self) -> tuple[str, str]:
        """Rename the temporaries to ``PREFIX.bin`` and ``PREFIX.idx``; returns both paths."""
        if self._state == "open":
            self.close()
        if self._state != "closed":
            raise RuntimeError(f"indexed dataset builder for {self.prefix} is already {self._state}")
        assert self._idx_tmp is not None
        os.replace(self._bin_tmp, self._bin_path)
        os.replace(self._idx_tmp, self._idx_path)
        with contextlib.suppress(OSError):
            dir_fd = os.open(self._bin_path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        self._state = "committed"
        return str(self._bin_path), str(self._idx_path)

    def finalize(self) -> tuple[str, str]:
        """:meth:`close` and :meth:`commit`."""
        return self.commit()

    def abort(self) -> None:
        """Drop everything written; the destination files are left as they were."""
        if self._state in ("committed", "aborted"):
            return
        with contextlib.suppress(Exception):
            self._bin.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        self._state = "aborted"

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            if self._state in ("open", "closed"):
                self.commit()
        else:
            self.abort()

    def __del__(self) -> None:  # an abandoned builder must not leave temporaries behind
        with contextlib.suppress(Exception):
            if getattr(self, "_state", "aborted") in ("open", "closed"):
                self.abort()


# --------------------------------------------------------------------------------------------- reading


class IndexedDataset:
    """Read-only view of ``PREFIX.bin`` / ``PREFIX.idx`` (memory-mapped; nothing is loaded eagerly).

    ``len(ds)`` is the number of sequences; ``ds[i]`` is sequence ``i`` as a read-only numpy array
    (a slice ``ds[a:b]`` gives a list of arrays); ``ds.get(i, offset, length)`` reads part of one.
    Truncated or inconsistent files raise :class:`UserError` naming the file.
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = os.fspath(prefix)
        self._open()

    def _open(self) -> None:
        idx_path = index_file_path(self.prefix)
        bin_path = data_file_path(self.prefix)
        for path, what in ((idx_path, "index (.idx)"), (bin_path, "data (.bin)")):
            if not os.path.isfile(path):
                raise UserError(f"{path}: indexed dataset {what} file not found (prefix {self.prefix})")
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as fh:
            header = fh.read(_HEADER_SIZE)
        magic = header[: len(INDEX_MAGIC)]
        if magic != INDEX_MAGIC:
            if INDEX_MAGIC.startswith(magic):
                raise UserError(f"{idx_path}: truncated index ({idx_size} bytes, shorter than the header)")
            raise UserError(
                f"{idx_path}: not a Megatron MMIDIDX index (magic {magic!r}, expected {INDEX_MAGIC!r})"
            )
        if len(header) < _HEADER_SIZE:
            raise UserError(f"{idx_path}: truncated index header ({len(header)} of {_HEADER_SIZE} bytes)")
        (version,) = struct.unpack_from("<Q", header, 9)
        if version != INDEX_VERSION:
            raise UserError(f"{idx_path}: unsupported index version {version} (expected {INDEX_VERSION})")
        (code,) = struct.unpack_from("<B", header, 17)
        if code not in DTYPE_CODES:
            raise UserError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n_seq, n_doc = struct.unpack_from("<QQ", header, 18)
        expected = _HEADER_SIZE + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if idx_size < expected:
            raise UserError(
                f"{idx_path}: truncated index ({idx_size} bytes; the header promises {n_seq} sequences and "
                f"{n_doc} document indices, {expected} bytes)"
            )
        if idx_size > expected:
            raise UserError(
                f"{idx_path}: {idx_size - expected} unexpected trailing bytes after the index arrays"
            )
        if n_doc < 1:
            raise UserError(f"{idx_path}: corrupt index (document index array is empty)")
        buf = np.memmap(idx_path, dtype=np.uint8, mode="r")
        off = _HEADER_SIZE
        self._sequence_lengths = np.frombuffer(buf, dtype="<i4", count=n_seq, offset=off)
        off += 4 * n_seq
        self._sequence_pointers = np.frombuffer(buf, dtype="<i8", count=n_seq, offset=off)
        off += 8 * n_seq
        self._document_indices = np.frombuffer(buf, dtype="<i8", count=n_doc, offset=off)
        self._idx_buf = buf
        self._validate(idx_path, bin_path)
        total_bytes = int(self._sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        if total_bytes:
            self._bin: np.ndarray = np.memmap(bin_path, dtype=self.dtype, mode="r")
        else:
            self._bin = np.zeros(0, dtype=self.dtype)
        self._doc_lengths: np.ndarray | None = None
        self._doc_offsets: np.ndarray | None = None

    def _validate(self, idx_path: str, bin_path: str) -> None:
        lengths, pointers, docs = self._sequence_lengths, self._sequence_pointers, self._document_indices
        n = lengths.size
        if n and int(lengths.min()) < 0:
            raise UserError(f"{idx_path}: corrupt index (negative sequence length)")
        itemsize = self.dtype.itemsize
        expected_ptr = np.zeros(n, dtype=np.int64)
        if n > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=expected_ptr[1:])
        if n and not np.array_equal(expected_ptr, pointers):
            bad = int(np.flatnonzero(expected_ptr != pointers)[0])
            raise UserError(
                f"{idx_path}: corrupt index (sequence {bad} points at byte {int(pointers[bad])}, expected "
                f"{int(expected_ptr[bad])})"
            )
        if int(docs[0]) != 0 or int(docs[-1]) != n or (docs.size > 1 and bool(np.any(np.diff(docs) < 0))):
            raise UserError(
                f"{idx_path}: corrupt index (document indices must rise from 0 to the sequence count {n})"
            )
        need = int(lengths.sum(dtype=np.int64)) * itemsize
        have = os.path.getsize(bin_path)
        if have < need:
            raise UserError(
                f"{bin_path}: truncated data file ({have} bytes; {idx_path} needs {need} bytes of "
                f"{self.dtype})"
            )
        if have > need:
            raise UserError(
                f"{bin_path}: {have - need} bytes more than {idx_path} describes; the .bin and .idx do not "
                "belong together"
            )

    # -- pickling: reopen the files instead of copying memory maps

    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.prefix = state["prefix"]
        self._open()

    def close(self) -> None:
        """Drop the memory maps (the object is unusable afterwards)."""
        for name in ("_bin", "_idx_buf", "_sequence_lengths", "_sequence_pointers", "_document_indices"):
            with contextlib.suppress(AttributeError):
                delattr(self, name)

    # -- the index

    def __len__(self) -> int:
        return int(self._sequence_lengths.size)

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 [N]: elements per sequence."""
        return self._sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 [N]: byte offset of each sequence in ``.bin``."""
        return self._sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64 [D+1]: document d holds sequences ``document_indices[d] : document_indices[d+1]``."""
        return self._document_indices

    @property
    def num_documents(self) -> int:
        return int(self._document_indices.size - 1)

    @property
    def num_tokens(self) -> int:
        return int(self._bin.size)

    def max_token_id(self, chunk: int = 1 << 24) -> int:
        """The largest token id in ``.bin`` (-1 when empty); reads the file once in chunks."""
        best = -1
        for start in range(0, int(self._bin.size), chunk):
            best = max(best, int(self._bin[start : start + chunk].max()))
        return best

    @property
    def document_lengths(self) -> np.ndarray:
        """int64 [D]: elements per document (the sum of its sequences)."""
        if self._doc_lengths is None:
            cum = np.zeros(len(self) + 1, dtype=np.int64)
            np.cumsum(self._sequence_lengths, out=cum[1:])
            self._doc_lengths = np.diff(cum[self._document_indices])
        return self._doc_lengths

    @property
    def document_offsets(self) -> np.ndarray:
        """int64 [D]: element offset in ``.bin`` of each document's first token."""
        if self._doc_offsets is None:
            lengths = self.document_lengths
            offsets = np.zeros(lengths.size, dtype=np.int64)
            if lengths.size > 1:
                np.cumsum(lengths[:-1], out=offsets[1:])
            self._doc_offsets = offsets
        return self._doc_offsets

    # -- the tokens

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("indexed dataset slices must be contiguous (step 1)")
            return [self[i] for i in range(start, stop)]
        i = int(idx)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences in {self.prefix}")
        start = int(self._sequence_pointers[i]) // self.dtype.itemsize
        return self._bin[start : start + int(self._sequence_lengths[i])]

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Elements ``[offset, offset + length)`` of sequence ``idx`` (to its end if ``length`` is None)."""
        seq = self[idx]
        if offset < 0 or offset > seq.size:
            raise IndexError(f"offset {offset} out of range for sequence {idx} of length {seq.size}")
        end = seq.size if length is None else offset + int(length)
        if length is not None and (length < 0 or end > seq.size):
            raise IndexError(f"offset {offset} + length {length} exceeds sequence {idx} of length {seq.size}")
        return seq[offset:end]

    def get_document(self, doc: int) -> np.ndarray:
        """All elements of document ``doc`` (its sequences are contiguous in ``.bin``)."""
        if not 0 <= doc < self.num_documents:
            raise IndexError(
                f"document {doc} out of range for {self.num_documents} documents in {self.prefix}"
            )
        start = int(self.document_offsets[doc])
        return self._bin[start : start + int(self.document_lengths[doc])]

    def read(self, start: int, length: int) -> np.ndarray:
        """``length`` elements of the whole token stream from element ``start`` (crossing sequences)."""
        if start < 0 or length < 0 or start + length > self._bin.size:
            raise IndexError(
                f"elements [{start}, {start + length}) out of range for {self._bin.size} in {self.prefix}"
            )
        return self._bin[start : start + length]

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, dtype={self.dtype}, sequences={len(self)}, "
            f"documents={self.num_documents}, tokens={self.num_tokens})"
        )


def merge_datasets(
    prefixes: Iterable[str | os.PathLike[str]], output_prefix: str | os.PathLike[str]
) -> IndexedDataset:
    """Concatenate datasets (same dtype) into ``output_prefix``, atomically; returns the result."""
    prefixes = [os.fspath(p) for p in prefixes]
    if not prefixes:
        raise UserError("merge: no input datasets")
    first = IndexedDataset(prefixes[0])
    with IndexedDatasetBuilder(output_prefix, dtype=first.dtype) as builder:
        for p in prefixes:
            builder.add_index(p)
    first.close()
    return IndexedDataset(output_prefix)
