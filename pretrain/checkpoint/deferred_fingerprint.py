"""The weights fingerprint computed while a conversion writes its output, patched in at the end.

A conversion records the weights fingerprint (:mod:`pretrain.checkpoint.fingerprint`) in every
output rank file's ``args`` (and a ``torch_dist`` checkpoint's ``common.pt``). Computing it first
is a full pass over the source before anything is written; instead :class:`DeferredFingerprint`
digests the source on a background thread (a second reader, or for a legacy source a second
view of the same mapped rank files, whose ``tensor()`` only reads them)
while the files are written with :data:`PLACEHOLDER`, a string of the same length, and
:func:`patch_fingerprint` then writes the value over it in place, before the output directory is
renamed into place. The files end byte for byte as if the value had been known from the start:

* ``torch.save`` files are zip archives whose ``data.pkl`` record is stored uncompressed, so the
  67 placeholder bytes are overwritten and that record's CRC-32 fixed in its data descriptor (or
  local header) and in the central directory;
* torch's writer ends each archive with ``.data/serialization_id``: 20 digits hashing the record
  names, then 20 digits chaining every earlier record's CRC-32 (``c10::hash_combine``), so that
  record is recomputed (and its CRC-32 fixed) too.

Used by default for legacy output; ``MLM_FINGERPRINT_OVERLAP=1`` for ``torch_dist`` too (faster,
over the memory bound at 3B: :func:`overlap_enabled`), ``=0`` never (the fingerprint first).
"""

from __future__ import annotations

import os
import struct
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pretrain.checkpoint.fingerprint import SCHEME, is_fingerprint, weights_fingerprint
from pretrain.checkpoint.types import TensorSource
from pretrain.utils.errors import UserError

PLACEHOLDER = f"{SCHEME}:" + "0" * 64
_MASK = (1 << 64) - 1
_LOCAL, _CENTRAL, _DESCRIPTOR = b"PK\x03\x04", b"PK\x01\x02", b"PK\x07\x08"


def overlap_enabled(ckpt_format: str) -> bool:
    """Whether a conversion writing ``ckpt_format`` (``torch`` or ``torch_dist``) computes the
    fingerprint while writing: ``MLM_FINGERPRINT_OVERLAP`` ``0``/``1``, by default yes.

    ``torch_dist`` output once digested first: its writer holds about two of the largest tensors,
    and the background reader's joins of row-parallel tensors took legacy -> torch_dist at 3B to
    0.93 GB, over the issue's bound (2 x the largest tensor + 0.5 GB = 0.89 GB). Since every
    source's row- and column-parallel blocks are hashed where they lie (no joins), the overlap costs
    it 0.01 GB there (0.232 GB against 0.223) and saves the digest's time: 3B 12.4 -> 7.8 s, 1B
    5.9-6.6 -> 4.5-5.6 s."""
    value = os.environ.get("MLM_FINGERPRINT_OVERLAP", "").strip().lower()
    if value in ("0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    return ckpt_format in ("torch", "torch_dist")


class DeferredFingerprint:
    """``weights_fingerprint(open_source())`` on a daemon thread; :meth:`result` waits for it."""

    def __init__(self, open_source: Callable[[], TensorSource]) -> None:
        self._stop = threading.Event()
        self._value: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(open_source,), name="fingerprint", daemon=True
        )
        self._thread.start()

    def _run(self, open_source: Callable[[], TensorSource]) -> None:
        try:
            # one digest thread: the writer holds the other core, and one tensor in flight keeps the
            # writer's memory bound (2 x the largest tensor + 0.5 GB) with room to spare
            self._value = weights_fingerprint(open_source(), stop=self._stop, workers=1)
        except BaseException as exc:  # noqa: BLE001 - raised again by result() in the writing thread
            self._error = exc

    def result(self) -> str:
        """The fingerprint; the background failure is raised here (the command fails with it)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value

    def cancel(self) -> None:
        """Stop reading the source (the writing failed) and wait for the thread."""
        self._stop.set()
        self._thread.join()

    def patcher(self, extra_files: Callable[[Path], object] | None) -> Callable[[Path], None]:
        """An ``extra_files(tmp)`` hook for the writers: ``extra_files``, then the patch of every
        ``.pt`` file under ``tmp`` (run inside the temp directory, before its rename)."""

        def finish(tmp: Path) -> None:
            if extra_files is not None:
                extra_files(tmp)
            patch_fingerprint(tmp, self.result())

        return finish


@contextmanager
def deferred_fingerprint(open_source: Callable[[], TensorSource]) -> Iterator[DeferredFingerprint]:
    """A :class:`DeferredFingerprint` cancelled if the block fails (its thread never outlives it)."""
    job = DeferredFingerprint(open_source)
    try:
        yield job
    except BaseException:
        job.cancel()
        raise


def patch_fingerprint(root: Path, value: str) -> list[Path]:
    """Write ``value`` over :data:`PLACEHOLDER` in every ``torch.save`` file under ``root`` that
    holds it; returns those files (at least one, or ``UserError``)."""
    if not is_fingerprint(value):
        raise ValueError(f"{value!r} is not a weights fingerprint")
    patched = [p for p in sorted(root.rglob("*.pt")) if p.is_file() and _patch_file(p, value.encode())]
    if not patched:
        raise UserError(f"{root}: no written file holds the weights fingerprint placeholder")
    return patched


def _patch_file(path: Path, value: bytes) -> bool:
    """Patch one ``torch.save`` archive in place; ``False`` when it holds no placeholder."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        central = _central_offsets(path, zf)
    pkl = next((i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"), None)
    if pkl is None or pkl.compress_type != zipfile.ZIP_STORED:
        return False
    with open(path, "r+b") as fh:
        start = _data_offset(fh, pkl)
        fh.seek(start)
        data = fh.read(pkl.file_size)
        if PLACEHOLDER.encode() not in data:
            return False
        data = data.replace(PLACEHOLDER.encode(), value)
        fh.seek(start)
        fh.write(data)
        crcs = {i.filename: i.CRC for i in infos}
        crcs[pkl.filename] = zlib.crc32(data)
        _set_crc(fh, pkl, central[pkl.filename], crcs[pkl.filename])
        sid = next((i for i in infos if i.filename.endswith(".data/serialization_id")), None)
        if sid is not None:
            _rewrite_serialization_id(fh, infos, sid, central[sid.filename], crcs)
    return True


def _rewrite_serialization_id(fh, infos: list[zipfile.ZipInfo], sid: zipfile.ZipInfo, central_at: int,
                              crcs: dict[str, int]) -> None:  # fmt: skip
    """torch's id: 20 digits of the record-name hash (kept), 20 of the chained earlier CRC-32s."""
    chained = 0
    for info in infos[: infos.index(sid)]:
        chained = (
            chained ^ (crcs[info.filename] + 0x9E3779B9 + ((chained << 6) & _MASK) + (chained >> 2))
        ) & _MASK
    start = _data_offset(fh, sid)
    fh.seek(start)
    old = fh.read(sid.file_size)
    new = old[:20] + f"{chained:020d}".encode()
    if len(old) != 40 or len(new) != 40:
        raise ValueError(f"{fh.name}: unexpected serialization_id {old!r}")
    fh.seek(start)
    fh.write(new)
    _set_crc(fh, sid, central_at, zlib.crc32(new))


def _data_offset(fh, info: zipfile.ZipInfo) -> int:  # noqa: ANN001
    fh.seek(info.header_offset)
    head = fh.read(30)
    if head[:4] != _LOCAL:
        raise ValueError(f"{fh.name}: {info.filename} has no local header")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _set_crc(fh, info: zipfile.ZipInfo, central_at: int, crc: int) -> None:  # noqa: ANN001
    """The record's CRC-32 where its local entry keeps it (torch's writer streams records: flag
    bit 3, the CRC in the data descriptor after the data, the header's left 0; else the header at
    offset 14) and in its central directory entry (offset 16)."""
    packed = struct.pack("<I", crc)
    fh.seek(info.header_offset + 6)
    if struct.unpack("<H", fh.read(2))[0] & 0x8:
        end = _data_offset(fh, info) + info.compress_size
        fh.seek(end)
        fh.seek(end + 4 if fh.read(4) == _DESCRIPTOR else end)
    else:
        fh.seek(info.header_offset + 14)
    fh.write(packed)
    fh.seek(central_at + 16)
    fh.write(packed)


def _central_offsets(path: Path, zf: zipfile.ZipFile) -> dict[str, int]:
    """Each record's central directory entry offset (walked from the directory's start)."""
    offsets: dict[str, int] = {}
    with open(path, "rb") as fh:
        fh.seek(zf.start_dir)  # type: ignore[attr-defined]
        for _ in zf.infolist():
            at = fh.tell()
            head = fh.read(46)
            if head[:4] != _CENTRAL:
                raise ValueError(f"{path}: malformed zip central directory")
            name_len, extra_len, comment_len = struct.unpack("<HHH", head[28:34])
            name = fh.read(name_len).decode("utf-8")
            offsets[name] = at
            fh.seek(extra_len + comment_len, os.SEEK_CUR)
    return offsets
