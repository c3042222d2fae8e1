"""Bytes that lie in a mapped file are copied file to file by the kernel, and only when exact.

* :func:`source_of` finds a buffer's file and offset in a private, writable mapping (as
  ``torch.load(mmap=True)`` maps) and in a read-only one; never in anonymous memory, in a buffer
  shorter than ``MIN_BYTES``, in a mapping whose page was written (its private copy is not the
  file), nor in a mapping whose file name now holds another file.
* :func:`write_gathered` copies such chunks with ``copy_file_range`` between chunks written from
  memory, at an offset and at the file position; a kernel that refuses leaves the rest to memory
  writes; a disk error is raised.
* Conversions (legacy -> ``torch_dist``, legacy -> HF, HF -> legacy, ``torch_dist`` -> HF) write
  the same bytes with the copies as without, and do copy.
"""

from __future__ import annotations

import errno
import mmap
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import pretrain.utils.mapped_source as mapped_source
from pretrain.utils.gathered_write import write_gathered
from pretrain.utils.mapped_source import MIN_BYTES, _MappedFiles, source_of

SIZE = 4 * MIN_BYTES


@pytest.fixture(autouse=True)
def _copying() -> Iterator[None]:
    """Every test starts with copying on (a test that refuses it must not leave it off)."""
    before = mapped_source._FILES.enabled
    mapped_source._FILES.enabled = mapped_source._MappedFiles().enabled
    yield
    mapped_source._FILES.enabled = before


@pytest.fixture
def payload(tmp_path: Path) -> Path:
    path = tmp_path / "source.bin"
    path.write_bytes(bytes(range(256)) * (SIZE // 256))
    return path


def _private_map(path: Path) -> tuple[mmap.mmap, int]:
    """A private, writable mapping of the whole file, as ``torch.load(mmap=True)`` makes."""
    fd = os.open(path, os.O_RDONLY)
    return mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE), fd


def _copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Byte counts of each ``copy_file_range`` call from now on."""
    calls: list[int] = []
    real = os.copy_file_range

    def counted(src: int, dst: int, count: int, *args: object) -> int:
        n = real(src, dst, count, *args)  # type: ignore[arg-type]
        calls.append(n)
        return n

    monkeypatch.setattr(os, "copy_file_range", counted)
    return calls


def test_a_private_mapping_is_its_file_from_the_right_offset(payload: Path) -> None:
    mapped, fd = _private_map(payload)
    try:
        view = memoryview(mapped)[MIN_BYTES : 3 * MIN_BYTES]
        found = source_of(view)
        assert found is not None
        src, at = found
        assert at == MIN_BYTES
        assert os.pread(src, len(view), at) == view.tobytes()
        view.release()
    finally:
        mapped.close()
        os.close(fd)


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
def test_a_read_only_mapping_and_a_tensor_over_it(payload: Path) -> None:
    fd = os.open(payload, os.O_RDONLY)
    mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    try:
        t = torch.frombuffer(mapped, dtype=torch.uint8)[MIN_BYTES:]  # a tensor whose bytes are the file's
        found = source_of(t.numpy().data)
        assert found is not None and found[1] == MIN_BYTES
        del t
    finally:
        mapped.close()
        os.close(fd)


def test_anonymous_short_and_written_buffers_are_not_the_file(payload: Path) -> None:
    assert source_of(memoryview(bytearray(SIZE))) is None
    assert source_of(torch.zeros(SIZE, dtype=torch.uint8).numpy().data) is None
    mapped, fd = _private_map(payload)
    try:
        assert source_of(memoryview(mapped)[: MIN_BYTES - 1]) is None  # too short to be worth a call
        assert source_of(memoryview(mapped)[:MIN_BYTES]) is not None
        mapped[2 * MIN_BYTES + 5] ^= 0xFF  # this page is now the process's own copy
        assert source_of(memoryview(mapped)[:MIN_BYTES]) is not None  # other pages still are the file's
        assert source_of(memoryview(mapped)[MIN_BYTES : 3 * MIN_BYTES]) is None
    finally:
        mapped.close()
        os.close(fd)


def test_a_file_mapped_again_at_the_same_addresses_at_another_offset(payload: Path) -> None:
    """The kernel hands the freed addresses of a window of a file to the next window of the same
    length: an answer from the earlier read of the maps would name the old offset (it did)."""
    files = _MappedFiles()
    fd = os.open(payload, os.O_RDONLY)
    try:
        first = mmap.mmap(fd, SIZE // 2, offset=0, prot=mmap.PROT_READ)
        found = files.source_of(memoryview(first))
        assert found is not None and found[1] == 0
        first.close()
        second = mmap.mmap(fd, SIZE // 2, offset=SIZE // 2, prot=mmap.PROT_READ)
        try:
            found = files.source_of(memoryview(second))
            assert found is not None and found[1] == SIZE // 2
            assert os.pread(found[0], 64, found[1]) == second[:64]
        finally:
            second.close()
    finally:
        os.close(fd)


def test_a_name_that_now_holds_another_file_is_not_opened(payload: Path, tmp_path: Path) -> None:
    mapped, fd = _private_map(payload)
    try:
        files = _MappedFiles()
        files._reread()
        view = memoryview(mapped)
        mapping = files._lookup(np.frombuffer(view, dtype=np.uint8).ctypes.data, SIZE)
        assert mapping is not None and mapping.inode == payload.stat().st_ino
        view.release()
        other = tmp_path / "other.bin"
        other.write_bytes(b"\x00" * SIZE)
        os.replace(other, payload)  # the mapped file's name now holds another file
        assert files._fd(mapping) is None
    finally:
        mapped.close()
        os.close(fd)


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLM_COPY_FILE_RANGE", "0")
    assert not _MappedFiles().enabled


@pytest.mark.parametrize("at", [None, 100], ids=["file-position", "offset"])
def test_written_chunks_mix_copies_and_memory_writes(
    payload: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: int | None
) -> None:
    mapped, fd = _private_map(payload)
    out = tmp_path / "out.bin"
    try:
        whole = memoryview(mapped)
        chunks = [
            memoryview(b"head"),
            whole[: 2 * MIN_BYTES],
            memoryview(b"x" * 10),
            whole[MIN_BYTES:],
            whole[:7],
        ]
        calls = _copies(monkeypatch)
        with open(out, "wb") as fh:
            if at is not None:
                fh.write(b"\x01" * at)
                fh.flush()
                os.lseek(fh.fileno(), 0, os.SEEK_SET)  # the position must not matter at an offset
            write_gathered(fh.fileno(), chunks, at)
            if at is None:
                assert os.lseek(fh.fileno(), 0, os.SEEK_CUR) == sum(map(len, chunks))
        expected = (b"\x01" * (at or 0)) + b"".join(c.tobytes() for c in chunks)
        assert out.read_bytes() == expected
        assert sum(calls) == 2 * MIN_BYTES + (SIZE - MIN_BYTES)
        whole.release()
        for c in chunks:
            c.release()
    finally:
        mapped.close()
        os.close(fd)


@pytest.mark.parametrize("code", [errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL])
def test_a_refusing_kernel_leaves_the_writes_to_memory(
    payload: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    refused: list[int] = []

    def refuse(*args: object) -> int:
        refused.append(1)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "copy_file_range", refuse)
    mapped, fd = _private_map(payload)
    try:
        view = memoryview(mapped)
        with open(tmp_path / "out.bin", "wb") as fh:
            write_gathered(fh.fileno(), [view[:SIZE], view[: 2 * MIN_BYTES]])
        assert (tmp_path / "out.bin").read_bytes() == view.tobytes() + view[: 2 * MIN_BYTES].tobytes()
        assert refused == [1]  # asked once, then off
        assert not mapped_source._FILES.enabled
        view.release()
    finally:
        mapped.close()
        os.close(fd)


def test_a_disk_error_is_raised(payload: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "copy_file_range", full)
    mapped, fd = _private_map(payload)
    try:
        view = memoryview(mapped)
        with open(tmp_path / "out.bin", "wb") as fh, pytest.raises(OSError, match="No space"):
            write_gathered(fh.fileno(), [view[:SIZE]])
        view.release()
    finally:
        mapped.close()
        os.close(fd)


# --- conversions: the same bytes with the copies as without ---------------------------------------


def _data_files(root: Path) -> dict[str, bytes]:
    """Every weights file under ``root``: ``.distcp`` and ``.safetensors`` whole; a rank file's zip
    records checked against their CRCs, each but its pickle (which names the source's path) and
    its random ``serialization_id``. (``.metadata`` holds a fresh save id: left out.)"""
    out: dict[str, bytes] = {}
    for p in sorted(root.rglob("*")):
        if p.suffix in (".distcp", ".safetensors"):
            out[str(p.relative_to(root))] = p.read_bytes()
        elif p.suffix == ".pt":
            with zipfile.ZipFile(p) as zf:
                assert zf.testzip() is None, p
                for info in zf.infolist():
                    if not info.filename.endswith(("data.pkl", "serialization_id")):
                        out[f"{p.relative_to(root)}:{info.filename}"] = zf.read(info)
    return out


def _convert(argv: list[str]) -> None:
    from tools.convert_cli import main

    assert main(argv) == 0


def test_conversions_write_the_same_bytes_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.convert_fixtures import write_ours
    from tests.gpt_fixtures import full_weights, tiny_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = tiny_config(num_layers=2, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                      add_bias_linear=False, num_query_groups=2, untie_embeddings_and_output_weights=True)  # fmt: skip
    ck = write_ours(tmp_path / "ck", cfg, full_weights(cfg), tp=2, pp=2)
    vocab = ["--vocab-size", str(cfg.vocab_size)]
    runs = {
        "torch_dist": ["reshard", "--load", str(ck), "--target-tp", "2", "--target-pp", "1", "--ckpt-format",
                       "torch_dist"],
        "hf": ["to-hf", "--load", str(ck), "--weights-only", "--no-verify", *vocab],
        "back": ["from-hf", "--load", "{hf}", "--tp", "2", "--pp", "2", "--weights-only"],
        "dist_hf": ["to-hf", "--load", "{torch_dist}", "--weights-only", "--no-verify", *vocab],
    }  # fmt: skip
    outputs: dict[bool, dict[str, dict[str, bytes]]] = {}
    for copying in (False, True):
        monkeypatch.setattr(mapped_source, "MIN_BYTES", 1 if copying else 1 << 62)
        calls = _copies(monkeypatch)
        done: dict[str, Path] = {}
        for name, argv in runs.items():
            save = tmp_path / f"{name}_{copying}"
            _convert([a.format(**{k: str(v) for k, v in done.items()}) for a in argv] + ["--save", str(save)])
            done[name] = save
        outputs[copying] = {name: _data_files(path) for name, path in done.items()}
        assert (len(calls) > 0) == copying
    for name in runs:
        assert outputs[True][name] and outputs[True][name] == outputs[False][name], name


def test_a_source_file_is_let_go_once_no_longer_mapped(payload: Path, tmp_path: Path) -> None:
    """A descriptor kept for copying does not outlive the file's mappings (a deleted source's
    space is not held by this process)."""
    files = _MappedFiles()
    mapped, fd = _private_map(payload)
    try:
        assert files.source_of(memoryview(mapped)[:SIZE]) is not None
    finally:
        mapped.close()
        os.close(fd)
    other = tmp_path / "other.bin"
    other.write_bytes(b"\x02" * SIZE)
    fd2 = os.open(other, os.O_RDONLY)
    again = mmap.mmap(fd2, 0, prot=mmap.PROT_READ)
    try:
        assert files.source_of(memoryview(again)[:SIZE]) is not None  # (maps read again)
        open_inodes = {inode for _, inode in files._fds}
        assert payload.stat().st_ino not in open_inodes and other.stat().st_ino in open_inodes
    finally:
        again.close()
        os.close(fd2)
