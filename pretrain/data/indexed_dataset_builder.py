"""Writing Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``, format in
:mod:`pretrain.data.indexed_dataset`) atomically, and merging several into one.

:class:`IndexedDatasetBuilder` writes both files as hidden temporaries beside the destination and
renames them only in :meth:`~IndexedDatasetBuilder.finalize` (``.bin`` first, then ``.idx``); an
exception or :meth:`~IndexedDatasetBuilder.abort` leaves no file behind.
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

from pretrain.data.indexed_dataset import (
    INDEX_MAGIC,
    INDEX_VERSION,
    IndexedDataset,
    data_file_path,
    dtype_code,
    index_file_path,
)
from pretrain.utils.errors import UserError


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
