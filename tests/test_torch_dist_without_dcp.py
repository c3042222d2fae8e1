"""Reading a ``torch_dist`` checkpoint does not import ``torch.distributed.checkpoint`` (seconds of
imports): ``.metadata`` unpickles into plain classes that hold what dcp's own classes hold, and
every tensor and stored object is read from the data files as dcp reads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pretrain.checkpoint.torch_dist.reader as dist_reader
from pretrain.checkpoint.opener import find_iteration_dir, open_checkpoint
from pretrain.checkpoint.torch_dist import dcp_meta
from pretrain.checkpoint.torch_dist.storage_dcp import read_real_dcp_metadata
from tests.convert_fixtures import write_bf16_llama_torch_dist
from tests.preimported import run_python

ROOT = Path(__file__).parents[1]


def _facts(md: object) -> tuple[dict[str, object], dict[object, object]]:
    """What a reader uses of a dcp ``Metadata`` (dcp's classes or ours), as plain values."""
    tensors: dict[str, object] = {}
    for key, item in md.state_dict_metadata.items():  # type: ignore[attr-defined]
        if type(item).__name__ == "BytesStorageMetadata":
            tensors[key] = "bytes"
        else:
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in item.chunks)
            tensors[key] = (tuple(item.size), item.properties.dtype, chunks)
    stored = {
        (k.fqn, None if k.offset is None else tuple(k.offset)): (
            v.relative_path, v.offset, v.length, getattr(v, "transform_descriptors", None)
        )
        for k, v in md.storage_data.items()  # type: ignore[attr-defined]
    }  # fmt: skip
    return tensors, stored


def _same_metadata(it_dir: Path) -> None:
    ours, theirs = dcp_meta.read_dcp_metadata(it_dir), read_real_dcp_metadata(it_dir)
    assert _facts(ours) == _facts(theirs)
    for key in theirs.storage_data:  # our keys find the same entries
        mine = dcp_meta.MetadataIndex(key.fqn, key.offset)
        assert ours.storage_data[mine].offset == theirs.storage_data[key].offset


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)])
def test_our_metadata_classes_hold_what_dcps_hold(tmp_path: Path, tp: int, pp: int) -> None:
    write_bf16_llama_torch_dist(tmp_path / "ck", tp=tp, pp=pp)
    _same_metadata(find_iteration_dir(tmp_path / "ck", None)[0])


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
def test_reading_every_tensor_imports_no_dcp(tmp_path: Path) -> None:
    full = write_bf16_llama_torch_dist(tmp_path / "ck", tp=2, pp=2)
    torch.save(full, tmp_path / "full.pt")
    script = f"""
import sys, torch
from pretrain.checkpoint.opener import open_checkpoint
reader = open_checkpoint({str(tmp_path / "ck")!r})
full = torch.load({str(tmp_path / "full.pt")!r})
for name in reader.names():
    t = reader.tensor(name)
    assert torch.equal(t, full[name][: t.shape[0]]), name
    reader.row_pieces(name), reader.column_pieces(name)
assert "torch.distributed.checkpoint" not in sys.modules, "dcp imported"
assert "torch.distributed.tensor" not in sys.modules, "DTensor imported"
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_items_dcp_must_read_go_through_dcp_with_the_same_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_bf16_llama_torch_dist(tmp_path / "ck", tp=2, pp=1)
    ours = open_checkpoint(tmp_path / "ck")
    direct = {n: ours.tensor(n).clone() for n in ours.names()}
    import pretrain.checkpoint.torch_dist.storage_dcp as storage_dcp

    through_dcp: list[str] = []
    real = storage_dcp.dcp_read_region

    def counted(path: Path, key: str, out: torch.Tensor, offsets: tuple[int, ...]) -> None:
        through_dcp.append(key)
        real(path, key, out, offsets)

    monkeypatch.setattr(dist_reader, "transformed", lambda info: True)  # as if compressed
    monkeypatch.setattr(storage_dcp, "dcp_read_region", counted)
    again = open_checkpoint(tmp_path / "ck")
    for name, t in direct.items():
        assert torch.equal(again.tensor(name), t), name
    assert len(through_dcp) >= len(direct)


def test_a_chunk_missing_from_the_data_is_one_line(tmp_path: Path) -> None:
    write_bf16_llama_torch_dist(tmp_path / "ck", tp=2, pp=1)
    reader = open_checkpoint(tmp_path / "ck")
    name = next(n for n in reader.names() if "query_key_value" in n)
    ref = reader.refs[name]
    md = reader.meta[ref.key]
    layer0 = next(c for c in md.chunks if c.offsets[0] == ref.index[0])  # the layer's stored chunk
    reader.storage.storage_data.pop(dcp_meta.MetadataIndex(ref.key, layer0.offsets))
    reader.mapped = None
    from pretrain.utils.errors import UserError

    with pytest.raises(UserError, match=rf"cannot read tensor {ref.key}.*not stored as the \.metadata says"):
        reader.tensor(name)


@pytest.mark.slow
def test_megatron_cores_metadata_reads_the_same(tmp_path: Path) -> None:
    """megatron-core's own save (its save plans in ``planner_data``, its common state)."""
    pytest.importorskip("megatron.core")
    from pretrain.tokenizer.train_tiny import train_tiny_gpt2_bpe

    tok = train_tiny_gpt2_bpe(tmp_path / "tok", vocab_size=500)
    done = run_python("tests.megatron_core_vocab_peer", [str(tmp_path / "mc"), str(tok / "vocab.json"),
                      str(tok / "merges.txt"), "--case", "llama", "--tp", "2", "--pp", "1"])  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    it_dir = find_iteration_dir(tmp_path / "mc" / "dist", None)[0]
    _same_metadata(it_dir)
    common = dist_reader.read_common(it_dir)
    assert common["args"] is not None
