"""Megatron-layout checkpoint save/load: names, nesting, atomicity, safe loading, round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.args import checkpoint_args, model_config_from_args
from pretrain.checkpoint.legacy.io import load_checkpoint, save_checkpoint
from pretrain.checkpoint.legacy.layout import TRACKER, read_tracker
from pretrain.models.gpt import GPTModel
from pretrain.models.init import init_model_parameters
from pretrain.models.sharding import gather_full_state_dict
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from pretrain.pipeline.partition import build_model_chunks
from pretrain.utils.errors import UserError
from tests.distributed import run_distributed
from tests.gpt_fixtures import tiny_config


def test_single_process_round_trip(tmp_path: Path) -> None:
    cfg = tiny_config()
    ps = ParallelState.single(seed=1)
    model = GPTModel(cfg, ps)
    init_model_parameters(model, seed=3)
    args = checkpoint_args(cfg, ParallelConfig(), model_type="gpt")
    save_checkpoint(tmp_path, 20, [model], ps, args=args, opt_param_scheduler={"num_steps": 20})
    assert read_tracker(tmp_path) == 20
    rank_file = tmp_path / "iter_0000020" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(rank_file, weights_only=True)  # args: a Namespace, allow-listed on import
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == 20
    emb = state["model"]["embedding.word_embeddings.weight"]  # megatron-core's names (the default)
    assert emb.shape == (1024, cfg.hidden_size)  # padded for tp=1
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in state["model"]
    assert model_config_from_args(state["args"]) == cfg
    assert not list(tmp_path.glob("*.tmp"))

    other = GPTModel(cfg, ps)
    rest = load_checkpoint(tmp_path, [other], ps)
    assert rest["opt_param_scheduler"] == {"num_steps": 20}
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n


def test_missing_and_corrupt_files_are_user_errors(tmp_path: Path) -> None:
    cfg = tiny_config()
    ps = ParallelState.single()
    model = GPTModel(cfg, ps)
    with pytest.raises(UserError, match=TRACKER):
        load_checkpoint(tmp_path, [model], ps)
    save_checkpoint(tmp_path, 1, [model], ps, args=checkpoint_args(cfg, ParallelConfig(), model_type="gpt"))
    (tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"garbage")
    with pytest.raises(UserError, match="cannot be loaded safely"):
        load_checkpoint(tmp_path, [model], ps)


def _save_load(rank: int, world: int, cfg, root: str):
    pc = ParallelConfig(tp=2, pp=2, vp=1)
    ps = ParallelState.from_distributed(pc, seed=0)
    chunks = build_model_chunks(cfg, ps)
    for c in chunks:
        init_model_parameters(c, seed=5)
    save_checkpoint(root, 7, chunks, ps, args=checkpoint_args(cfg, pc, model_type="gpt"))
    fresh = build_model_chunks(cfg, ps)
    load_checkpoint(root, fresh, ps)
    full: dict[str, torch.Tensor] = {}
    for c in fresh:
        full.update(gather_full_state_dict(c))
    return full


@pytest.mark.slow
def test_tp2_pp2_save_layout_and_reload(tmp_path: Path) -> None:
    cfg = tiny_config(num_layers=4)
    results = run_distributed(_save_load, 4, cfg, str(tmp_path))
    names = sorted(p.name for p in (tmp_path / "iter_0000007").iterdir())
    assert names == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    last = torch.load(tmp_path / "iter_0000007" / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=True)
    assert last["model"]["output_layer.weight"].shape == (1024 // 2, cfg.hidden_size)  # the tied copy
    assert "decoder.layers.1.mlp.linear_fc2.weight" in last["model"]
    assert "decoder.layers.2.mlp.linear_fc2.weight" not in last["model"]  # local index
    ref = GPTModel(cfg, ParallelState.single())
    init_model_parameters(ref, seed=5)
    expected = gather_full_state_dict(ref)
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r)
    assert set(merged) == set(expected)
    for k, v in expected.items():
        assert torch.equal(merged[k], v), k
