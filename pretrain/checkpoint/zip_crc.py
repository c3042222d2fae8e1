"""CRC-32 of a ``torch.save`` zip archive's records, filled in after torch's writer left them 0.

torch's zip writer (miniz) computes each record's CRC-32 with a table-driven loop: on a 2-core
host it was a third of writing a legacy rank file, slower than the write itself. Told not to
compute it (``PyTorchFileWriter(..., compute_crc32=False)``) the writer puts 0 in the two places
a stored record's CRC lives, its data descriptor (or local header) and its central-directory entry, and nothing else
changes. (torch's records carry a data descriptor after their data, flag bit 3: there, not in
the local header, is the CRC a reader checks.) :func:`fill_crc32` writes the real values there, from CRCs the caller computed while it
had the bytes in memory (``known``) or read back from the file, so the file is byte for byte what
torch's writer makes with CRCs on, and any zip tool verifies it (``zipfile.testzip``). The CRC
itself comes from ISA-L (``isal``, about 9 GB/s per core here with carry-less multiply), or
``zlib`` where isal is missing.

Zip layout read here (APPNOTE 4.3): the end-of-central-directory record (and, for archives
past 4 GiB or 65535 entries, the zip64 locator and record before it) gives the central
directory's offset; each central entry gives its name and its local header's offset (in the
zip64 extra field when the 32-bit field holds ``0xFFFFFFFF``). Offsets are relative to the
archive's first byte, ``start`` in the file (a ``.distcp`` file holds one archive per tensor).
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO

try:
    from isal.isal_zlib import crc32 as _fast_crc32
except ImportError:  # pragma: no cover - isal ships wheels for the platforms torch does
    _fast_crc32 = zlib.crc32

crc32: Callable[..., int] = _fast_crc32  # crc32(data, value=0) -> int, as zlib.crc32

_EOCD, _ZIP64_LOCATOR, _ZIP64_EOCD = 0x06054B50, 0x07064B50, 0x06064B50
_CENTRAL, _LOCAL = 0x02014B50, 0x04034B50
_DESCRIPTOR = struct.pack("<I", 0x08074B50)  # the optional signature of a data descriptor
_SERIALIZATION_ID = ".data/serialization_id"
_U64 = (1 << 64) - 1
_MAP_FROM = 1 << 20  # records this large are mapped to compute their CRC, smaller ones read


@dataclass(frozen=True)
class ZipRecord:
    """One stored record: ``name`` (without the archive's folder), where its two CRC fields are
    (absolute file offsets: the central entry's, and the local header's or, for a record with a
    data descriptor, the descriptor's) and where its data is."""

    name: str
    central_crc_at: int
    local_crc_at: int
    data_at: int
    size: int


def _pread(fd: int, n: int, at: int) -> bytes:
    data = os.pread(fd, n, at)
    if len(data) != n:
        raise ValueError(f"zip archive truncated: wanted {n} bytes at {at}, got {len(data)}")
    return data


def _central_directory(fd: int, start: int, end: int) -> tuple[int, int]:
    """(offset in the archive, entry count) of the central directory, from the end records."""
    eocd_at = end - 22  # torch writes no archive comment, so the record is the last 22 bytes
    sig, _, _, _, entries, _, cd_offset, comment = struct.unpack("<IHHHHIIH", _pread(fd, 22, eocd_at))
    if sig != _EOCD or comment != 0:
        raise ValueError(f"no zip end-of-central-directory record at {eocd_at}")
    if entries == 0xFFFF or cd_offset == 0xFFFFFFFF:
        sig, _, z64_at, _ = struct.unpack("<IIQI", _pread(fd, 20, eocd_at - 20))
        if sig != _ZIP64_LOCATOR:
            raise ValueError(f"no zip64 locator before {eocd_at}")
        record = _pread(fd, 56, start + z64_at)
        sig, _, _, _, _, _, _, entries, _, cd_offset = struct.unpack("<IQHHIIQQQQ", record)
        if sig != _ZIP64_EOCD:
            raise ValueError(f"no zip64 end-of-central-directory record at {start + z64_at}")
    return cd_offset, entries


def _zip64_fields(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int]:
    """(data size, local header offset), each from the zip64 extra field (id 1) where its 32-bit
    field is ``0xFFFFFFFF``: the field holds the uncompressed size, the compressed size and the
    offset, in that order, each present only when needed."""
    if 0xFFFFFFFF not in (usize, csize, offset):
        return usize, offset
    i = 0
    while i + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, i)
        if tag == 1:
            values = iter(struct.unpack_from(f"<{n // 8}Q", extra, i + 4))
            size = next(values) if usize == 0xFFFFFFFF else usize
            if csize == 0xFFFFFFFF:
                next(values)
            return size, next(values) if offset == 0xFFFFFFFF else offset
        i += 4 + n
    raise ValueError("zip64 central entry without its extra field")


def zip_records(fd: int, start: int = 0, end: int | None = None) -> list[ZipRecord]:
    """The stored records of the archive in bytes ``[start, end)`` of file ``fd`` (end: file end)."""
    end = os.fstat(fd).st_size if end is None else end
    cd_offset, entries = _central_directory(fd, start, end)
    at = start + cd_offset
    records = []
    for _ in range(entries):
        (sig, _, _, flags, method, _, _, _, csize, usize, nlen, xlen, clen, _, _, _,
         offset) = struct.unpack("<IHHHHHHIIIHHHHHII", _pread(fd, 46, at))  # fmt: skip
        if sig != _CENTRAL:
            raise ValueError(f"no zip central directory entry at {at}")
        if method != 0:
            raise ValueError(f"zip record at {at} is compressed (torch stores records)")
        name = _pread(fd, nlen, at + 46).decode()
        size, offset = _zip64_fields(_pread(fd, xlen, at + 46 + nlen), usize, csize, offset)
        local = start + offset
        sig, _, _, _, _, _, _, _, _, lnlen, lxlen = struct.unpack("<IHHHHHIIIHH", _pread(fd, 30, local))
        if sig != _LOCAL:
            raise ValueError(f"no zip local header at {local}")
        data_at = local + 30 + lnlen + lxlen
        crc_at = local + 14
        if flags & 0x8:  # a data descriptor after the data holds the CRC (torch's writer)
            crc_at = data_at + size + (4 if _pread(fd, 4, data_at + size) == _DESCRIPTOR else 0)
        records.append(ZipRecord(name.split("/", 1)[-1], at + 16, crc_at, data_at, size))
        at += 46 + nlen + xlen + clen
    return records


def crc_of_file_range(fd: int, at: int, size: int) -> int:
    """CRC-32 of ``size`` bytes of ``fd`` from ``at``, over a read-only mapping of them (no copy:
    4x faster than reading them back here, 2 GB in 0.2 s)."""
    if size < _MAP_FROM:
        return crc32(_pread(fd, size, at))
    start = at - at % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, at + size - start, offset=start, prot=mmap.PROT_READ) as mapped:
        view = memoryview(mapped)
        try:
            return crc32(view[at - start :])
        finally:
            view.release()


def _combined(crcs: list[int]) -> int:
    """torch's ``combined_uncomp_crc32_``: ``c10::hash_combine`` folded over the records' CRCs
    (64-bit: ``seed ^ (crc + 0x9e3779b9 + (seed << 6) + (seed >> 2))``)."""
    seed = 0
    for value in crcs:
        seed = (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _U64) + (seed >> 2)) & _U64)) & _U64
    return seed


def _serialization_id(fd: int, rec: ZipRecord, crcs: list[int]) -> int:
    """torch's last record, ``.data/serialization_id``: 20 digits of its own, then 20 digits of
    the combined CRC of the non-empty records before it (``crcs``), which a writer that skipped
    the CRCs made from zeros. Rewritten from the real ones (the bytes torch writes with CRCs on);
    its own CRC."""
    text = _pread(fd, rec.size, rec.data_at)
    if rec.size == 40 and text.isdigit() and int(text[20:]) == _combined([0] * len(crcs)):
        text = text[:20] + b"%020d" % _combined(crcs)
        os.pwrite(fd, text, rec.data_at)
    return crc32(text)


def fill_crc32(fh: IO[bytes], known: Mapping[str, int] | None = None, *, start: int = 0,
               end: int | None = None) -> None:  # fmt: skip
    """Write every record's CRC-32 into its central entry and its data descriptor (or local
    header), for the archive at bytes ``[start, end)`` of the open, readable and writable file
    ``fh``. ``known`` maps a record's name within the archive (``data.pkl``, ``data/0``) to its
    CRC; the others are read back. A torch archive's serialization id is made as torch makes it."""
    fh.flush()
    fd = fh.fileno()
    known = known or {}
    records = zip_records(fd, start, end)
    crcs: list[int] = []  # of the non-empty records so far
    for i, rec in enumerate(records):
        if rec.name == _SERIALIZATION_ID and i == len(records) - 1:
            value = _serialization_id(fd, rec, crcs)
        else:
            given = known.get(rec.name)
            value = crc_of_file_range(fd, rec.data_at, rec.size) if given is None else given
        if rec.size:
            crcs.append(value)
        packed = struct.pack("<I", value)
        os.pwrite(fd, packed, rec.local_crc_at)
        os.pwrite(fd, packed, rec.central_crc_at)
