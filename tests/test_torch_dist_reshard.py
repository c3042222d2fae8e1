"""Reshard between legacy ``torch`` and ``torch_dist`` in both directions, any TP/PP/VP: exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from pretrain.checkpoint.legacy.writer import write_layout
from pretrain.checkpoint.opener import load_canonical
from pretrain.checkpoint.plan import ModelSpec, chunk_slots
from pretrain.checkpoint.torch_dist.writer import write_torch_dist
from pretrain.checkpoint.types import DictSource
from pretrain.config import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.utils.errors import UserError
from tools.convert_cli import main as convert


def _source(**kw: object) -> DictSource:
    fields: dict[str, object] = dict(
        num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
        vocab_size=100, max_position_embeddings=32, normalization="RMSNorm", swiglu=True,
        position_embedding_type="rope", untie_embeddings_and_output_weights=True, add_bias_linear=False,
    )  # fmt: skip
    cfg = ModelConfig(**{**fields, **kw})  # type: ignore[arg-type]
    spec = ModelSpec(kind="gpt", cfg=cfg)
    gen = torch.Generator().manual_seed(3)
    slots = chunk_slots(spec, tp=1, pre_process=True, post_process=True, layer_numbers=range(4))
    full = {
        s.canonical: torch.randn((100, *s.shape[1:]) if s.vocab else s.shape, generator=gen) for s in slots
    }
    return DictSource(spec=spec, full=full)


def _same(path: Path, src: DictSource) -> None:
    got, spec, _ = load_canonical(path)
    assert spec.cfg == src.spec.cfg
    assert sorted(got) == sorted(src.full)
    assert all(torch.equal(got[n], src.full[n]) for n in got)


@pytest.mark.parametrize(
    ("legacy", "dist_tp"),
    [(ParallelConfig(tp=2, pp=2, vp=2), 2), (ParallelConfig(tp=4, pp=1), 1), (ParallelConfig(tp=1, pp=4), 4)],
)
def test_legacy_to_torch_dist_and_back_is_exact(tmp_path: Path, legacy: ParallelConfig, dist_tp: int) -> None:
    src = _source()
    write_layout(src, tmp_path / "legacy", legacy)
    _same(tmp_path / "legacy", src)
    assert convert(["reshard", "--load", str(tmp_path / "legacy"), "--save", str(tmp_path / "dist"),
                    "--target-tp", str(dist_tp), "--target-pp", "2", "--ckpt-format", "torch_dist",
                    "--verify"]) == 0  # fmt: skip
    _same(tmp_path / "dist", src)
    assert convert(["reshard", "--load", str(tmp_path / "dist"), "--save", str(tmp_path / "back"),
                    "--target-tp", "2", "--target-pp", "2", "--target-vp", "2", "--verify"]) == 0  # fmt: skip
    _same(tmp_path / "back", src)


def test_torch_dist_layout_is_megatron_cores(tmp_path: Path) -> None:
    src = _source(qk_layernorm=True)
    write_torch_dist(src, tmp_path / "d", ParallelConfig(tp=2, pp=2))
    it = tmp_path / "d" / "release"
    assert json.loads((it / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    md = FileSystemReader(str(it)).read_metadata().state_dict_metadata
    qkv = md["decoder.layers.self_attention.linear_qkv.weight"]
    assert tuple(qkv.size) == (4, (8 + 2 * 2) * 8, 64) and len(qkv.chunks) == 4  # stacked, one chunk a layer
    assert tuple(md["embedding.word_embeddings.weight"].size) == (256, 64)  # padded for tp 2
    assert tuple(md["output_layer.weight"].size) == (256, 64)
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in md  # TE spelling, as megatron-core saves
    assert "decoder.layers.self_attention.q_layernorm.weight" in md
    assert "decoder.layers.mlp.linear_fc1._extra_state/shard_3_4" in md


def test_tanh_gelu_without_biases_is_refused_for_megatron_core(tmp_path: Path) -> None:
    """megatron-core computes tanh GeLU only in its fused bias-GeLU kernel: without biases the
    file would claim a function megatron-core cannot compute."""
    with pytest.raises(UserError, match="tanh GeLU without linear biases"):
        write_torch_dist(_source(swiglu=False, gelu="tanh"), tmp_path / "d", ParallelConfig(tp=1, pp=1))
    assert not (tmp_path / "d").exists()
    write_torch_dist(_source(swiglu=False, gelu="erf"), tmp_path / "e", ParallelConfig(tp=1, pp=1))
    assert (tmp_path / "e" / "release" / "common.pt").is_file()
