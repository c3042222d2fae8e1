"""Streaming Hugging Face export: sharded safetensors written tensor by tensor, never the whole model.

The tensors come one layer at a time from :func:`tools.hf_plan.stream_hf_tensors`, in the order
its plan announced. :class:`ShardWriter` writes them as ``save_pretrained`` does: ``model.safetensors`` when everything
fits in ``max_shard_size``, else ``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``). Each tensor's
bytes go straight to the shard's data file; the shard is closed by writing its safetensors header
and appending the data with a kernel-side copy (``os.copy_file_range``), so resident memory stays
about one layer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from pretrain.checkpoint.tensor_meta import meta_like
from pretrain.checkpoint.types import ColumnPieces, RowPieces
from pretrain.utils.errors import UserError
from pretrain.utils.gathered_write import column_chunks, flat_bytes, write_gathered
from tools.hf_plan import Planned

__all__ = ["Planned", "ShardWriter", "meta_like", "split_shards", "write_planned_shards"]

DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_shard_size(text: str | int) -> int:
    """``"5GB"`` (10^9), ``"500MiB"`` (2^20), ``"100kb"`` or a byte count, as ``save_pretrained`` reads them."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
        if m is None or m.group(2).upper() not in _UNITS:
            raise UserError(f"--max-shard-size {text}: expected a size such as 5GB, 500MB or 2GiB")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value < 1:
        raise UserError(f"--max-shard-size {text}: must be at least 1 byte")
    return value


def split_shards(tensors: Sequence[Planned], max_bytes: int) -> list[list[Planned]]:
    """The shards :class:`ShardWriter` fills from ``tensors`` in order: a new one when the next
    tensor would take a non-empty shard over ``max_bytes`` (``save_pretrained``'s rule)."""
    shards: list[list[Planned]] = []
    size = 0
    for t in tensors:
        if not shards or (size and size + t.nbytes > max_bytes):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _header(entries: dict[str, dict[str, object]], metadata: dict[str, str]) -> bytes:
    """A safetensors header: 8-byte length, then JSON padded with spaces to 8-byte aligned data."""
    header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # 8-byte aligned data, as the safetensors writer pads
    return struct.pack("<Q", len(header)) + header


def _entries(tensors: Sequence[Planned]) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    offset = 0
    for t in tensors:
        out[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + t.nbytes]}  # fmt: skip
        offset += t.nbytes
    return out


class ShardWriter:
    """Sharded safetensors in ``directory`` (see the module docstring); ``add`` then ``close``.

    With ``plan`` (every tensor ``add`` will get, in order: :func:`plan_hf_tensors`) each shard's
    header is written first and each tensor's bytes go straight after it: every byte is written
    once. Without a plan, or from the first ``add`` that departs from it, a shard's data is
    written first and the file is finished by writing the header and copying the data after it
    (in the kernel). The files are the same bytes either way."""

    def __init__(
        self, directory: Path, *, max_shard_size: int, metadata: dict[str, str] | None = None,
        plan: Sequence[Planned] | None = None,
    ) -> None:  # fmt: skip
        self.directory = Path(directory)
        self.max_bytes = max_shard_size
        self.metadata = {"format": "pt", **(metadata or {})}
        self.shards: list[tuple[Path, list[str]]] = []  # finished shard files (temporary names)
        self.total = 0
        self._planned = split_shards(plan, max_shard_size) if plan is not None else None
        self._expect: list[Planned] | None = None  # the open shard's plan, while adds follow it
        self._file: BinaryIO | None = None
        self._data_start = 0  # where the open file's tensor data begins
        self._header: dict[str, dict[str, object]] = {}
        self._offset = 0

    def add(self, name: str, tensor: torch.Tensor | RowPieces | ColumnPieces) -> None:
        """Append ``tensor`` (or its rows as :class:`RowPieces`, written block by block where they
        lie, or its :class:`ColumnPieces`, each row gathered from them)."""
        t, chunks = _data(tensor)
        if t.dtype not in SAFETENSORS_DTYPES:
            raise UserError(f"to-hf: tensor {name} has dtype {t.dtype}, which safetensors cannot store")
        nbytes = t.numel() * t.element_size()  # (the chunks' lengths summed: one per gathered row)
        if self._file is not None and self._offset and self._offset + nbytes > self.max_bytes:
            self._finish_shard()
        if self._file is None:
            self._open_shard()
        if self._expect is not None:
            i = len(self._header)
            if i >= len(self._expect) or self._expect[i] != Planned(name, t.dtype, tuple(t.shape)):
                self._expect = self._planned = None  # departed from the plan: rewrite this shard's header
        assert self._file is not None
        write_gathered(self._file.fileno(), chunks)
        self._header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self._offset, self._offset + nbytes]}  # fmt: skip
        self._offset += nbytes
        self.total += nbytes

    def _open_shard(self) -> None:
        i = len(self.shards)
        if self._planned is not None and i < len(self._planned):
            self._expect = self._planned[i]
            self._file = open(self.directory / f".shard{i}.safetensors", "wb", buffering=0)  # noqa: SIM115
            head = _header(_entries(self._expect), self.metadata)
            write_gathered(self._file.fileno(), [memoryview(head)])
            self._data_start = len(head)
        else:
            self._expect = self._planned = None
            self._file = open(self.directory / f".shard{i}.data", "wb", buffering=0)  # noqa: SIM115
            self._data_start = 0

    def _finish_shard(self) -> None:
        assert self._file is not None
        written = Path(self._file.name)
        self._file.close()
        self._file = None
        path = self.directory / f".shard{len(self.shards)}.safetensors"
        if self._expect is None or len(self._header) != len(self._expect):  # header still to write
            final = path.with_suffix(".header")
            with open(final, "wb") as out, open(written, "rb") as src:
                out.write(_header(self._header, self.metadata))
                src.seek(self._data_start)
                _copy(src, out, self._offset)
            written.unlink()
            final.rename(path)
        self.shards.append((path, list(self._header)))
        self._header, self._offset, self._expect = {}, 0, None

    def close(self) -> list[Path]:
        """Finish the last shard, give the files their final names, write the index if sharded."""
        if self._file is not None or not self.shards:
            if self._file is None:
                self._open_shard()
            self._finish_shard()
        n = len(self.shards)
        names = shard_file_names(n)
        weight_map = {}
        for (path, tensors), final in zip(self.shards, names, strict=True):
            path.rename(self.directory / final)
            weight_map.update(dict.fromkeys(tensors, final))
        if n > 1:
            write_index(self.directory, weight_map, self.total)
        return [self.directory / f for f in names]


def shard_file_names(n: int) -> list[str]:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` for ``n`` > 1 shards."""
    return (
        ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )


def write_index(directory: Path, weight_map: dict[str, str], total: int) -> None:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it (sorted keys)."""
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _data(
    tensor: torch.Tensor | RowPieces | ColumnPieces,
) -> tuple[torch.Tensor, list[memoryview] | Iterator[memoryview]]:
    """A tensor's dtype and shape (a ``meta`` tensor for pieces) and its bytes in order."""
    if isinstance(tensor, ColumnPieces):
        meta = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
        return meta, _gathered_rows(tensor) if meta.numel() else []
    if isinstance(tensor, RowPieces):
        parts = [p.detach().to("cpu").contiguous() for p in tensor.parts]
        meta = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
        return meta, [flat_bytes(p) for p in parts if p.numel()]
    t = tensor.detach().to("cpu").contiguous()
    return t, [flat_bytes(t)] if t.numel() else []


def _gathered_rows(pieces: ColumnPieces) -> list[memoryview] | Iterator[memoryview]:
    """The joined tensor's bytes in row-major order: row ``r`` of each part in turn, where they
    lie or staged (:func:`~pretrain.utils.gathered_write.column_chunks`)."""
    return column_chunks([p.detach().to("cpu").contiguous() for p in pieces.parts])


def write_planned_shards(
    directory: Path, shards: Sequence[Sequence[Planned]], owned: Sequence[bool],
    tensors: Iterable[tuple[str, torch.Tensor | RowPieces | ColumnPieces]], *, metadata: dict[str, str] | None = None,
) -> None:  # fmt: skip
    """The ``owned`` shard files of ``shards`` (:func:`split_shards` of the plan) under their final
    names, from ``tensors`` (exactly the owned shards' tensors, in order): the bytes
    :class:`ShardWriter` writes for the same plan (a process of a split export writes its share)."""
    names = shard_file_names(len(shards))
    head = {"format": "pt", **(metadata or {})}
    expected = iter([(i, t) for i, shard in enumerate(shards) if owned[i] for t in shard])
    fh: BinaryIO | None = None
    current = -1
    try:
        for name, tensor in tensors:
            i, planned = next(expected, (-1, None))
            t, chunks = _data(tensor)
            if planned is None or planned != Planned(name, t.dtype, tuple(t.shape)):
                raise RuntimeError(
                    f"to-hf: tensor {name} {tuple(t.shape)} departs from the shard plan ({planned})"
                )
            if i != current:
                if fh is not None:
                    fh.close()
                fh = open(directory / names[i], "wb", buffering=0)  # noqa: SIM115
                write_gathered(fh.fileno(), [memoryview(_header(_entries(shards[i]), head))])
                current = i
            assert fh is not None
            write_gathered(fh.fileno(), chunks)
        if next(expected, None) is not None:
            raise RuntimeError("to-hf: fewer tensors than the shard plan")
    finally:
        if fh is not None:
            fh.close()


def _copy(src: BinaryIO, dst: BinaryIO, count: int) -> None:
    """Append ``count`` bytes of ``src`` from its position to ``dst``: in the kernel where possible."""
    dst.flush()
    start = src.tell()
    if hasattr(os, "copy_file_range"):
        try:
            done = 0
            while done < count:
                n = os.copy_file_range(src.fileno(), dst.fileno(), count - done)
                if n == 0:
                    break
                done += n
            if done == count:
                return
            src.seek(start + done)
        except OSError:
            src.seek(start)
    shutil.copyfileobj(src, dst, 1 << 20)
