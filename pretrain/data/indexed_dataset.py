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

Writing (atomic) is :class:`~pretrain.data.indexed_dataset_builder.IndexedDatasetBuilder`.
Token ids are written with :func:`optimal_dtype` (uint16 when the vocabulary has fewer than 65500
entries, else int32), as Megatron does.
"""

from __future__ import annotations

import contextlib
import os
import struct
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
