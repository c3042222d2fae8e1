"""``dcp.save`` without torch's slow CRC-32 loop, the CRCs filled in afterwards.

A ``.distcp`` file is one ``torch.save`` zip archive per stored chunk, back to back; the save's
``Metadata`` says where each lies (``storage_data``: file, offset, length). Torch's zip writer
computes CRC-32s at a fraction of the write speed (:mod:`pretrain.checkpoint.zip_crc`), so the
save runs with ``torch.serialization.set_crc32_options(False)`` and each archive of this
process's files then gets its CRCs from ISA-L: the files are the bytes the save writes with CRCs
on. Every process fixes only the files it wrote (``__<rank>_<n>.distcp``).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.serialization as ser
from torch.distributed.checkpoint.metadata import Metadata

from pretrain.checkpoint.zip_crc import fill_crc32

_ZIP_START = b"PK\x03\x04"


@contextmanager
def torch_crc32_off() -> Iterator[None]:
    """``torch.save`` writes CRC-32 fields as 0 inside this block (process-wide setting)."""
    previous = ser.get_crc32_options()
    ser.set_crc32_options(False)
    try:
        yield
    finally:
        ser.set_crc32_options(previous)


def save_then_fill_crc32(save: Callable[[], Metadata], directory: Path, rank: int) -> Metadata:
    """Run ``save`` (a ``dcp.save`` into ``directory``) with torch's CRCs off, then fill the CRCs
    of every archive in this rank's ``.distcp`` files and sync them. Returns the save's metadata."""
    with torch_crc32_off():
        metadata = save()
    spans: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for info in metadata.storage_data.values():
        if info.relative_path.startswith(f"__{rank}_"):
            spans[info.relative_path].append((info.offset, info.offset + info.length))
    for name, ranges in spans.items():
        with open(directory / name, "r+b") as fh:
            for start, end in sorted(ranges):
                if os.pread(fh.fileno(), 4, start) == _ZIP_START:  # a raw byte item is left as it is
                    fill_crc32(fh, start=start, end=end)
            os.fsync(fh.fileno())
    return metadata
