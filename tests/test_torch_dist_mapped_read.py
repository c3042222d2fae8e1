"""``torch_dist`` tensors are read from the memory-mapped data files (one copy into the target)
without dcp, and every region equals what ``dcp.load`` with torch's own ``FileSystemReader``
reads, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import pretrain.checkpoint.torch_dist.reader as dist_reader
import pretrain.checkpoint.torch_dist.storage_dcp as storage_dcp
from pretrain.checkpoint.opener import open_checkpoint
from tests.convert_fixtures import write_bf16_llama_torch_dist


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)])
def test_mapped_reads_equal_dcps_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int, pp: int
) -> None:
    full = write_bf16_llama_torch_dist(tmp_path / "ck", tp=tp, pp=pp)
    dcp_reads: list[int] = []
    real = FileSystemReader.read_data

    def counted(self, plan, planner):  # noqa: ANN001, ANN202
        dcp_reads.append(len(plan.items))
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", counted)
    reader = open_checkpoint(tmp_path / "ck")
    ours = {n: reader.tensor(n) for n in reader.names()}
    assert dcp_reads == []  # every tensor from the mapped files
    # dcp's load and reader throughout: every region as if its items needed dcp
    monkeypatch.setattr(dist_reader, "transformed", lambda info: True)
    monkeypatch.setattr(storage_dcp.SafeFileSystemReader, "read_data", counted)
    theirs = {n: open_checkpoint(tmp_path / "ck").tensor(n) for n in reader.names()}
    assert len(dcp_reads) >= len(theirs)
    for name, t in ours.items():
        assert t.dtype == theirs[name].dtype and torch.equal(t, theirs[name]), name
        assert torch.equal(t, full[name][: t.shape[0]] if t.shape != full[name].shape else full[name]), name
