"""A Llama-style model (RMSNorm, SwiGLU, RoPE, GQA, untied output, no biases) under every layout
equals one process: logits, losses, gradients and optimizer steps; GQA shards as Megatron does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.distributed import DDPConfig
from pretrain.models.gpt import GPTModel
from pretrain.models.init import init_model_parameters
from pretrain.models.sharding import (
    gather_full_state_dict,
    row_layout,
    shard_tensor,
    unshard_tensors,
)
from pretrain.parallel.state import ParallelState
from pretrain.utils.errors import UserError
from tests.distributed import run_distributed
from tests.dp_training import OPT, assert_params_close, global_batches, reference, worker_pipeline, worker_pp1
from tests.gpt_fixtures import batch, single_process_reference
from tests.llama_fixtures import llama_config
from tests.test_pipeline_equivalence import _pp_worker
from tests.test_tensor_parallel_gpt import (
    _init_full,  # the same worker: init at tp=world, gathered
    _tp_step,
)

TOL = {"rtol": 1e-5, "atol": 1e-6}
QKV = "language_model.encoder.layers.0.self_attention.query_key_value.weight"
FC1 = "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"


def llama_weights(cfg, seed: int = 1234) -> dict[str, torch.Tensor]:
    model = GPTModel(cfg, ParallelState.single())
    init_model_parameters(model, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    return {
        k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in gather_full_state_dict(model).items()
    }


def test_swiglu_shard_holds_its_slice_of_gate_and_up() -> None:
    cfg = llama_config()
    full = torch.arange(2 * 48 * 2).float().reshape(96, 2)  # rows [gate 0..47; up 48..95]
    lay = row_layout(FC1, cfg)
    shards = [shard_tensor(full, dim=0, tp_rank=r, tp=4, layout=lay) for r in range(4)]
    assert torch.equal(shards[1][:12], full[12:24]) and torch.equal(shards[1][12:], full[60:72])
    assert torch.equal(unshard_tensors(shards, dim=0, layout=lay), full)


def test_qkv_with_more_ranks_than_groups_replicates_key_value_heads() -> None:
    """2 groups of [4 q, k, v] at tp 4: rank 1 holds q heads 2, 3 of group 0 and group 0's k, v."""
    cfg = llama_config(hidden_size=16, num_attention_heads=8, num_query_groups=2)  # head_dim 2
    d = cfg.head_dim
    full = torch.arange(12 * d).float().reshape(12 * d, 1)  # rows [g][q0..q3, k, v][d]
    lay = row_layout(QKV, cfg)
    shards = [shard_tensor(full, dim=0, tp_rank=r, tp=4, layout=lay) for r in range(4)]
    rows = full.reshape(2, 6, d)
    assert torch.equal(shards[1].reshape(4, d), torch.cat([rows[0, 2:4], rows[0, 4:6]]))
    assert torch.equal(shards[2].reshape(4, d), torch.cat([rows[1, 0:2], rows[1, 4:6]]))
    assert torch.equal(unshard_tensors(shards, dim=0, layout=lay), full)
    shards[1] = shards[1] + 1
    with pytest.raises(ValueError, match="query group 0"):
        unshard_tensors(shards, dim=0, layout=lay)
    summed = unshard_tensors([s * 0 + 1 for s in shards], dim=0, layout=lay, replicas="sum")
    assert float(summed.reshape(2, 6, d)[0, 4:].min()) == 2.0  # k, v: two replicas each


def test_training_refuses_tp_beyond_query_groups() -> None:
    cfg = llama_config(num_query_groups=2)
    cfg.check_tensor_parallel(4)  # evaluation and resharding may replicate
    with pytest.raises(UserError, match="num_query_groups 2"):
        cfg.check_training_tensor_parallel(4)
    with pytest.raises(UserError, match="one must divide the other"):
        llama_config(hidden_size=48, num_attention_heads=12, num_query_groups=3).check_tensor_parallel(2)


@pytest.mark.slow
def test_initialisation_is_layout_independent_with_gqa_replication() -> None:
    cfg = llama_config()
    single = GPTModel(cfg, ParallelState.single())
    init_model_parameters(single, seed=42)
    ref = gather_full_state_dict(single)
    for full in run_distributed(_init_full, 4, cfg):  # tp 4 > 2 groups
        assert set(full) == set(ref)
        for k, v in ref.items():
            assert torch.equal(full[k], v), k


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "groups"), [(2, 2), (4, 4), (4, 2)])
def test_tp_equals_single_process(tp: int, groups: int) -> None:
    """Logits, loss and every gradient; (4, 2) evaluates 2 KV groups at tp 4 (replicated K/V heads;
    their gradients summed over the replicas equal the one-process gradient)."""
    cfg = llama_config(num_query_groups=groups, qk_layernorm=True, add_qkv_bias=True, use_rope_scaling=True,
                       rope_original_max_position_embeddings=8)  # fmt: skip
    weights, data = llama_weights(cfg), batch(cfg)
    ref_logits, ref_loss, ref_grads = single_process_reference(cfg, weights, data)
    for r in run_distributed(_tp_step, tp, cfg, weights, data):
        torch.testing.assert_close(r["logits"], ref_logits, **TOL)
        torch.testing.assert_close(r["loss"], ref_loss, **TOL)
        assert set(r["grads"]) == set(ref_grads)
        for name, g in ref_grads.items():
            torch.testing.assert_close(r["grads"][name], g, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "vp"), [(1, 2, 1), (1, 2, 2), (2, 2, 1)])
def test_pipeline_step_equals_single_process(tp: int, pp: int, vp: int) -> None:
    cfg = llama_config(num_layers=4)
    weights, data = llama_weights(cfg), batch(cfg, b=8, s=8)
    _, ref_loss, ref_grads = single_process_reference(cfg, weights, data)
    results = run_distributed(_pp_worker, tp * pp, cfg, weights, data, tp, pp, vp, 4, False)
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r["grads"])
        if r["last"]:
            torch.testing.assert_close(r["loss"], ref_loss, **TOL)
    assert set(merged) == set(ref_grads)
    assert "language_model.output_layer.weight" in merged
    for name, g in ref_grads.items():
        for r in results:
            if name in r["grads"]:
                torch.testing.assert_close(r["grads"][name], g, **TOL, msg=lambda s, n=name: f"{n}: {s}")


@pytest.mark.slow
@pytest.mark.parametrize(("world", "tp"), [(2, 1), (4, 2)])
def test_data_parallel_zero1_training_equals_single_process(world: int, tp: int) -> None:
    cfg = llama_config()
    weights, batches = llama_weights(cfg), global_batches(cfg, steps=3)
    opt_cfg = dataclasses.replace(OPT, use_distributed_optimizer=True)
    ref, ref_steps, _ = reference(cfg, weights, batches, opt_cfg)
    ddp_cfg = DDPConfig(use_distributed_optimizer=True)
    for r in run_distributed(worker_pp1, world, tp, cfg, weights, batches, ddp_cfg, opt_cfg, 2):
        assert_params_close(r["params"], ref)
        for (ok, norm), (_, ref_norm) in zip(r["steps"], ref_steps, strict=True):
            assert ok and norm == pytest.approx(ref_norm, rel=1e-5)


@pytest.mark.slow
def test_tp2_pp2_dp2_zero1_training_equals_single_process() -> None:
    cfg = llama_config(num_layers=4)
    weights, batches = llama_weights(cfg), global_batches(cfg, steps=2)
    opt_cfg = dataclasses.replace(OPT, use_distributed_optimizer=True)
    ref, _, _ = reference(cfg, weights, batches, opt_cfg)
    ddp_cfg = DDPConfig(use_distributed_optimizer=True)
    for r in run_distributed(worker_pipeline, 8, 2, 2, cfg, weights, batches, ddp_cfg, opt_cfg, 2):
        for name, v in r["params"].items():
            torch.testing.assert_close(v, ref[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
