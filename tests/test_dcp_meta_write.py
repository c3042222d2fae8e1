"""Our ``torch_dist`` writer writes, without importing ``torch.distributed.checkpoint``, the bytes
dcp's own ``dcp.save`` + ``FileSystemWriter`` write for the same save plan (``tests/dcp_reference.py``):
every ``.distcp`` file and the pickled ``.metadata`` (its random ``save_id`` made equal), for GPT
with a padded vocabulary, a Llama shape, MoE (stacked and per-layer keys), BERT, and optimizer
state (fp32 entries made from tensors, not stored blocks)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import pretrain.checkpoint.torch_dist.distcp_writer as distcp_writer
import pretrain.checkpoint.torch_dist.writer as writer
from pretrain.checkpoint.optimizer.state import OptimizerSource
from pretrain.checkpoint.plan import ModelSpec
from pretrain.checkpoint.types import DictSource
from pretrain.parallel.config import ParallelConfig
from tests.dcp_reference import dcp_save
from tests.gpt_fixtures import full_weights, tiny_config
from tests.test_bert_torch_dist import _source as bert_source
from tests.test_moe_mcore_formats import _Adam, moe_cfg, random_full

ROOT = Path(__file__).parents[1]
SAVE_ID = "00000000-1111-2222-3333-444444444444"


def _gpt() -> DictSource:
    cfg = tiny_config(num_layers=2, params_dtype="bfloat16")
    return DictSource(ModelSpec(kind="gpt", cfg=cfg), {k: v.bfloat16() for k, v in full_weights(cfg).items()})


def _llama() -> DictSource:
    cfg = tiny_config(
        num_layers=3, num_query_groups=2, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
        position_embedding_type="rope", untie_embeddings_and_output_weights=True, ffn_hidden_size=48,
    )  # fmt: skip
    return DictSource(ModelSpec(kind="gpt", cfg=cfg), full_weights(cfg))


def _moe(**kw: object) -> DictSource:
    cfg = moe_cfg(**kw)
    return DictSource(ModelSpec(kind="gpt", cfg=cfg), random_full(cfg, seed=3))


SOURCES = {
    "gpt bf16 tp2": (_gpt, ParallelConfig(tp=2, pp=1), False),
    "llama gqa": (_llama, ParallelConfig(tp=1, pp=1), False),
    "moe stacked": (_moe, ParallelConfig(tp=1, pp=1), False),
    "moe mixed layers": (lambda: _moe(moe_layer_freq=(1, 0, 1, 1)), ParallelConfig(tp=2, pp=1), False),
    "bert": (bert_source, ParallelConfig(tp=1, pp=1), False),
    "gpt + optimizer": (_gpt, ParallelConfig(tp=2, pp=1), True),
}


def _ours_and_dcps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, files: int
) -> tuple[Path, Path]:
    """Our save and dcp's of the same plan, each written at the same path (``x/release``: the
    ``checkpoint_id`` is pickled too) with the same ``save_id``; the two iteration directories."""
    make, target, with_optimizer = SOURCES[case]
    source = make()
    optimizer: OptimizerSource | None = _Adam(source.full) if with_optimizer else None
    monkeypatch.setattr(distcp_writer, "file_count", lambda: files)
    monkeypatch.setattr(writer, "new_save_id", lambda: SAVE_ID)
    monkeypatch.setattr("torch.distributed.checkpoint.filesystem._generate_uuid", lambda: SAVE_ID)
    writer.write_torch_dist(source, tmp_path / "x", target, optimizer=optimizer)
    (tmp_path / "x").rename(tmp_path / "ours")
    dcp_save(source, tmp_path / "x" / "release", target, thread_count=files, optimizer=optimizer)
    return tmp_path / "ours" / "release", tmp_path / "x" / "release"


def _stored(it_dir: Path) -> list[str]:
    return sorted(p.name for p in it_dir.iterdir() if p.suffix == ".distcp" or p.name == ".metadata")


@pytest.mark.parametrize("case", list(SOURCES))
def test_one_file_per_rank_every_byte_is_dcps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    ours, dcps = _ours_and_dcps(tmp_path, monkeypatch, case, files=1)
    assert _stored(ours) == _stored(dcps) == [".metadata", "__0_0.distcp"]
    for name in _stored(ours):
        assert (ours / name).read_bytes() == (dcps / name).read_bytes(), name


@pytest.mark.parametrize("case", ["gpt bf16 tp2", "moe mixed layers", "gpt + optimizer"])
def test_two_files_per_rank_are_dcps_and_so_is_the_metadata_up_to_dcps_thread_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """megatron-core's two files per rank: the files are dcp's; its ``storage_data`` comes in the
    order its threads finish (ours file by file), so its pickle is compared in our order."""
    ours, dcps = _ours_and_dcps(tmp_path, monkeypatch, case, files=2)
    assert _stored(ours) == _stored(dcps) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    for name in ("__0_0.distcp", "__0_1.distcp"):
        assert (ours / name).read_bytes() == (dcps / name).read_bytes(), name
    mine = pickle.loads((ours / ".metadata").read_bytes())
    theirs = pickle.loads((dcps / ".metadata").read_bytes())  # dcp's own classes (a test may import them)
    assert type(mine) is type(theirs)
    assert list(theirs.storage_data) != [] and set(theirs.storage_data) == set(mine.storage_data)
    order = {k: n for n, k in enumerate(mine.storage_data)}  # (dcp's own index objects kept)
    theirs.storage_data = dict(sorted(theirs.storage_data.items(), key=lambda kv: order[kv[0]]))
    assert pickle.dumps(theirs) == (ours / ".metadata").read_bytes()


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
def test_writing_imports_no_dcp(tmp_path: Path) -> None:
    script = f"""
import sys, torch
from pretrain.checkpoint.plan import ModelSpec
from pretrain.checkpoint.types import DictSource
from pretrain.checkpoint.torch_dist.writer import write_torch_dist
from pretrain.parallel.config import ParallelConfig
from tests.gpt_fixtures import full_weights, tiny_config
cfg = tiny_config(num_layers=2)
write_torch_dist(DictSource(ModelSpec(kind="gpt", cfg=cfg), full_weights(cfg)), {str(tmp_path / "ck")!r},
                 ParallelConfig(tp=2, pp=1))
assert "torch.distributed.checkpoint" not in sys.modules, "dcp was imported"
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    import torch.distributed.checkpoint as dcp

    state = {"decoder.final_layernorm.weight": torch.zeros(32)}
    with warnings.catch_warnings():  # "assuming ... a single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(tmp_path / "ck" / "release"), no_dist=True)  # dcp reads it
    assert torch.count_nonzero(state["decoder.final_layernorm.weight"]) > 0


def test_a_save_split_over_two_processes_is_read_by_dcp(tmp_path: Path) -> None:
    """Under torchrun each rank writes its chunks into ``__<rank>_<n>.distcp`` and rank 0 the
    ``.metadata`` of them all: dcp's own ``dcp.load`` reads every tensor back (the files of both
    ranks written here in one process, as the ranks' plans are a pure function of the split)."""
    import torch.distributed.checkpoint as dcp

    from pretrain.checkpoint.torch_dist.dcp_meta_write import build_metadata, write_dcp_metadata
    from pretrain.checkpoint.work_split import WorkSplit

    source = _moe(moe_layer_freq=(1, 0, 1, 1))
    entries = writer._entries(source, 1)
    plans = writer._plans(entries, WorkSplit(rank=0, world=2))
    assert all(plans) and {i.key for i in plans[0]} != {i.key for i in plans[1]}
    make = writer._ChunkMaker(writer._fetcher(source, None))
    it_dir = tmp_path / "release"
    it_dir.mkdir()
    written = [distcp_writer.write_distcp_files(it_dir, rank, plans[rank], make) for rank in (0, 1)]
    write_dcp_metadata(it_dir, build_metadata(plans, written, checkpoint_id=it_dir, save_id=SAVE_ID))
    state = {e.key: torch.zeros(e.shape, dtype=e.dtype) for e in entries}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(it_dir), no_dist=True)
    fetch = writer._fetcher(source, None)
    for e in entries:
        for name, index in e.parts:
            want = fetch(e, name)
            got = state[e.key][index] if index else state[e.key]
            assert torch.equal(got, want), (e.key, index)


@pytest.mark.parametrize("where", ["data", "metadata"])
def test_a_failed_write_is_one_line_naming_the_save_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A disk error while writing the data files or the ``.metadata`` (as dcp's wrapper turned it
    into one line before) is one :class:`UserError` naming ``--save``; no directory is left."""
    import errno

    from pretrain.checkpoint.torch_dist import dcp_meta_write
    from pretrain.utils.errors import UserError

    def full(*_: object, **__: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "data":
        monkeypatch.setattr(distcp_writer, "_minimal", full)
    else:
        monkeypatch.setattr(dcp_meta_write, "dump_metadata", full)
    save = tmp_path / "out"
    with pytest.raises(UserError, match=rf"^{save}: cannot write the torch_dist (data|metadata) \(OSError: "):
        writer.write_torch_dist(_gpt(), save, ParallelConfig(tp=2, pp=1))
    assert list(tmp_path.iterdir()) == []
