"""``torch_dist`` tensors are read from the memory-mapped data files (one copy into the target),
and every region equals what torch's own ``FileSystemReader`` reads, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import pretrain.checkpoint.torch_dist.storage as storage
from pretrain.checkpoint.opener import open_checkpoint
from pretrain.checkpoint.plan import ModelSpec
from pretrain.checkpoint.torch_dist.writer import write_torch_dist
from pretrain.checkpoint.types import DictSource
from pretrain.parallel.config import ParallelConfig
from tests.gpt_fixtures import full_weights, tiny_config

LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
             num_query_groups=2, untie_embeddings_and_output_weights=True)  # fmt: skip


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)])
def test_mapped_reads_equal_dcps_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int, pp: int
) -> None:
    cfg = tiny_config(num_layers=4, params_dtype="bfloat16", **LLAMA)  # type: ignore[arg-type]
    full = {k: v.bfloat16() for k, v in full_weights(cfg).items()}
    write_torch_dist(
        DictSource(ModelSpec(kind="gpt", cfg=cfg), full), tmp_path / "ck", ParallelConfig(tp=tp, pp=pp)
    )
    dcp_reads: list[int] = []
    real = FileSystemReader.read_data

    def counted(self, plan, planner):  # noqa: ANN001, ANN202
        dcp_reads.append(len(plan.items))
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", counted)
    reader = open_checkpoint(tmp_path / "ck")
    ours = {n: reader.tensor(n) for n in reader.names()}
    assert dcp_reads == []  # every tensor from the mapped files
    monkeypatch.setattr(storage.SafeFileSystemReader, "read_data", counted)  # dcp's reader throughout
    theirs = {n: open_checkpoint(tmp_path / "ck").tensor(n) for n in reader.names()}
    assert len(dcp_reads) >= len(theirs)
    for name, t in ours.items():
        assert t.dtype == theirs[name].dtype and torch.equal(t, theirs[name]), name
        assert torch.equal(t, full[name][: t.shape[0]] if t.shape != full[name].shape else full[name]), name
