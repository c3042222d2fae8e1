"""A reshard cuts each target shard from the source's stored blocks (:mod:`pretrain.checkpoint.shard_views`):
views where a shard lies in one block, the blocks' rows joined where it spans several. The files
are byte for byte those cut from the joined tensors, for every split rule (SwiGLU blocks, GQA groups
kept whole or replicated over ``tp > groups``, row-parallel column ranges) and both source formats."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import pretrain.checkpoint.legacy.writer as legacy_writer
import pretrain.checkpoint.shard_views as shard_views
from pretrain.checkpoint.plan import ModelSpec
from pretrain.checkpoint.torch_dist.writer import write_torch_dist
from pretrain.checkpoint.types import DictSource
from pretrain.parallel.config import ParallelConfig
from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tools.convert_cli import main

os.environ["HF_HUB_OFFLINE"] = "1"
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("overrides", "source_tp", "target_tp", "source_format"),
    [
        (dict(LLAMA, num_query_groups=2), 2, 4, "legacy"),  # half a block each; QKV groups replicated at tp 4
        (dict(LLAMA, num_query_groups=4), 4, 2, "legacy"),  # two blocks per shard: joined
        (dict(LLAMA, num_query_groups=4), 2, 1, "legacy"),
        # 1003 tokens padded to a multiple of 125 tp: 1500 rows at tp 4, 1250 at tp 2 (stored rows cut),
        # and back (zero rows added)
        (dict(LLAMA, num_query_groups=2, make_vocab_size_divisible_by=125), 4, 2, "legacy"),
        (dict(LLAMA, num_query_groups=2, make_vocab_size_divisible_by=125), 2, 4, "torch_dist"),
        ({}, 2, 4, "legacy"),  # GPT-2: biases, fused QKV
        (dict(LLAMA, num_query_groups=2), 2, 4, "torch_dist"),
    ],
)  # fmt: skip
def test_shards_from_stored_blocks_are_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: dict[str, object],
    source_tp: int, target_tp: int, source_format: str,
) -> None:  # fmt: skip
    cfg = tiny_config(num_layers=2, num_attention_heads=8, **overrides)  # type: ignore[arg-type]
    full = full_weights(cfg)
    if source_format == "legacy":
        ck = write_ours(tmp_path / "ck", cfg, full, tp=source_tp, pp=1)
    else:
        ck = tmp_path / "ck"
        write_torch_dist(
            DictSource(ModelSpec(kind="gpt", cfg=cfg), full), ck, ParallelConfig(tp=source_tp, pp=1)
        )
    used: list[bool] = []
    real = shard_views.shard_from_pieces
    monkeypatch.setattr(legacy_writer, "shard_from_pieces", lambda *a, **k: _noted(used, real(*a, **k)))
    outs = {}
    for pieces in (True, False):
        monkeypatch.setattr(legacy_writer, "SHARDS_FROM_PIECES", pieces)
        outs[pieces] = tmp_path / f"out_{pieces}"
        argv = ["reshard", "--load", str(ck), "--save", str(outs[pieces]), "--target-tp", str(target_tp)]
        assert main([*argv, "--target-pp", "2"]) == 0
    # (at least) QKV, fc1, proj and fc2 of each layer, every target rank; at tp 1 the shard is
    # every block (their rows, or each row of each column block in turn)
    assert sum(used) >= 2 * 4 * target_tp
    got, want = _files(outs[True]), _files(outs[False])
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == want[name], name


def _noted(used: list[bool], out: torch.Tensor | None) -> torch.Tensor | None:
    used.append(out is not None)
    return out
