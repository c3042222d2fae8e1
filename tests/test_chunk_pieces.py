"""Tensors written from where they lie in the source, not from a joined copy.

* A Hugging Face directory read for from-hf (:func:`tools.hf_io.open_hf`) gives each canonical
  tensor as the HF tensors' row blocks (:meth:`LazySource.row_pieces`): a fused QKV as each
  group's q, k and v rows, SwiGLU's fc1 as gate and up, ``o_proj``/``down_proj`` as one column
  block. Joined, they are the tensor the maker builds.
* A ``torch_dist`` save writes each chunk from the source's blocks
  (:meth:`_ChunkMaker.pieces`): the ``.distcp`` bytes are those of the chunks
  joined first, for a legacy source (TP shards) and a Hugging Face one.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

import pretrain.checkpoint.torch_dist.writer as dist_writer
from pretrain.checkpoint.types import ColumnPieces, RowPieces
from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tools.convert_cli import main

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers")
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False)


def _files(root: Path) -> dict[str, object]:
    """Every file's bytes; a ``.metadata`` without ``storage_meta`` (a random save id and the
    temporary directory's name)."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name == ".metadata":
            with open(p, "rb") as fh:
                meta = pickle.load(fh)  # our own test output
            out[str(p.relative_to(root))] = {k: v for k, v in vars(meta).items() if k != "storage_meta"}
        elif p.is_file():
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


def test_hf_source_gives_each_tensor_as_the_hf_row_blocks(tmp_path: Path) -> None:
    """The blocks' shape: a QKV per group, fc1 as gate and up, proj as the mapped tensor itself.
    (The makers are the blocks' join, so what the rows are is proved elsewhere: the from-hf
    digests computed before streaming, tests/test_from_hf_streaming.py, and the conversions'
    parity with transformers.)"""
    from tests.test_from_hf_streaming import write_hf
    from tools.hf_io import open_hf

    src = write_hf(tmp_path / "hf", "qwen2")  # GQA (4 heads, 2 groups), QKV biases, tied embeddings
    source = open_hf(src)
    kinds: dict[str, int] = {}
    for name in source.names():
        pieces = source.row_pieces(name)
        assert pieces is not None, name
        assert torch.equal(torch.cat(pieces.parts), source.tensor(name)), name
        kinds[name] = len(pieces.parts)
    qkv = [n for n in kinds if "query_key_value.weight" in n]
    assert qkv and all(kinds[n] == 3 * 2 for n in qkv)  # per group: q heads, k, v
    assert all(kinds[n] == 6 for n in kinds if "query_key_value.bias" in n)
    assert all(kinds[n] == 2 for n in kinds if "dense_h_to_4h.weight" in n)  # gate, up
    proj = next(n for n in kinds if "self_attention.dense.weight" in n)
    columns = source.column_pieces(proj)
    assert isinstance(columns, ColumnPieces) and len(columns.parts) == 1
    assert columns.parts[0].data_ptr() == source.row_pieces(proj).parts[0].data_ptr()  # the mapped tensor
    cut = source.with_vocab(300)
    emb = next(n for n in kinds if "word_embeddings" in n)
    rows = cut.row_pieces(emb)
    assert isinstance(rows, RowPieces) and torch.equal(torch.cat(rows.parts), cut.tensor(emb))
    assert rows.shape[0] == 300


@pytest.mark.parametrize(
    ("overrides", "tp"), [(dict(LLAMA, num_query_groups=2), 2), ({}, 2), (dict(LLAMA, num_query_groups=4), 1)]
)
def test_torch_dist_chunks_from_a_legacy_checkpoints_shards_are_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: dict[str, object], tp: int
) -> None:
    cfg = tiny_config(num_layers=2, num_attention_heads=8, params_dtype="bfloat16", **overrides)  # type: ignore[arg-type]
    full = {k: v.bfloat16() for k, v in full_weights(cfg).items()}
    ck = write_ours(tmp_path / "ck", cfg, full, tp=tp, pp=1)
    used = _count_pieces(monkeypatch)
    outs = {}
    for pieces in (True, False):
        monkeypatch.setattr(dist_writer, "CHUNKS_FROM_PIECES", pieces)
        outs[pieces] = tmp_path / f"out_{pieces}"
        argv = [
            "reshard",
            "--load",
            str(ck),
            "--save",
            str(outs[pieces]),
            "--target-tp",
            "2",
            "--target-pp",
            "1",
        ]
        assert main([*argv, "--ckpt-format", "torch_dist"]) == 0
    # every layer's QKV and fc1 (rows of each shard); from two shards also proj and fc2 (column blocks)
    assert sum(used) >= (4 if tp > 1 else 2) * cfg.num_layers
    assert _files(outs[True]) == _files(outs[False])


def test_torch_dist_chunks_from_a_hf_directory_are_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_from_hf_streaming import write_hf

    src = write_hf(tmp_path / "hf", "llama_gqa")
    used = _count_pieces(monkeypatch)
    outs = {}
    for pieces in (True, False):
        monkeypatch.setattr(dist_writer, "CHUNKS_FROM_PIECES", pieces)
        outs[pieces] = tmp_path / f"out_{pieces}"
        argv = ["from-hf", "--weights-only", "--load", str(src), "--save", str(outs[pieces]), "--tp", "2"]
        assert main([*argv, "--ckpt-format", "torch_dist"]) == 0
    assert sum(used) >= 4 * 4  # 4 layers: QKV, fc1, proj, fc2 at least
    assert _files(outs[True]) == _files(outs[False])


def _count_pieces(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    used: list[bool] = []
    real = dist_writer._ChunkMaker.pieces

    def noted(self, item):  # noqa: ANN001, ANN202
        out = real(self, item)
        used.append(out is not None)
        return out

    monkeypatch.setattr(dist_writer._ChunkMaker, "pieces", noted)
    return used
