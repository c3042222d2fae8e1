"""A mixture-of-experts decoder (Mixtral / Qwen2-MoE shapes: routed experts, a gated shared
expert, dense and MoE layers mixed) under TP, PP and DP with ZeRO-1 equals one process: logits,
loss, every gradient (router and experts included) and the optimizer steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.distributed import DDPConfig
from pretrain.models.gpt import GPTModel
from pretrain.models.init import init_model_parameters
from pretrain.models.sharding import gather_full_state_dict
from pretrain.parallel.state import ParallelState
from tests.distributed import run_distributed
from tests.dp_training import OPT, assert_params_close, global_batches, reference, worker_pipeline, worker_pp1
from tests.gpt_fixtures import batch, single_process_reference
from tests.llama_fixtures import llama_config
from tests.test_pipeline_equivalence import _pp_worker
from tests.test_tensor_parallel_gpt import _tp_step

TOL = {"rtol": 1e-5, "atol": 1e-6}
ROUTER = "language_model.encoder.layers.0.mlp.router.weight"


def moe_config(**overrides: object):
    """4 experts, top-2, a gated shared expert; with 4 layers the second is dense."""
    layers = int(overrides.get("num_layers", 2))  # type: ignore[call-overload]
    kw: dict[str, object] = dict(
        num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=24,
        moe_shared_expert_gate=True, moe_layer_freq=(1, 0, 1, 1) if layers == 4 else 1,
    )  # fmt: skip
    kw.update(overrides)
    return llama_config(**kw)


def moe_weights(cfg, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Seeded weights, router rows scaled up so that routes differ between tokens."""
    model = GPTModel(cfg, ParallelState.single())
    init_model_parameters(model, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    full = {
        k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in gather_full_state_dict(model).items()
    }
    for k in full:
        if k.endswith("mlp.router.weight"):
            full[k] = full[k] * 20.0
    return full


def test_moe_model_holds_router_experts_and_shared_expert() -> None:
    cfg = moe_config(num_layers=4)
    names = set(moe_weights(cfg))
    assert ROUTER in names and "language_model.encoder.layers.1.mlp.dense_h_to_4h.weight" in names
    assert "language_model.encoder.layers.1.mlp.router.weight" not in names  # a dense layer
    assert "language_model.encoder.layers.3.mlp.experts.3.dense_4h_to_h.weight" in names
    assert "language_model.encoder.layers.0.mlp.shared_experts.gate_weight" in names


@pytest.mark.slow
def test_tp2_equals_single_process() -> None:
    cfg = moe_config()
    weights, data = moe_weights(cfg), batch(cfg)
    ref_logits, ref_loss, ref_grads = single_process_reference(cfg, weights, data)
    assert float(ref_grads[ROUTER].abs().sum()) > 0
    for r in run_distributed(_tp_step, 2, cfg, weights, data):
        torch.testing.assert_close(r["logits"], ref_logits, **TOL)
        torch.testing.assert_close(r["loss"], ref_loss, **TOL)
        assert set(r["grads"]) == set(ref_grads)
        for name, g in ref_grads.items():
            torch.testing.assert_close(r["grads"][name], g, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_tp2_pp2_step_equals_single_process() -> None:
    cfg = moe_config(num_layers=4)
    weights, data = moe_weights(cfg), batch(cfg, b=8, s=8)
    _, ref_loss, ref_grads = single_process_reference(cfg, weights, data)
    results = run_distributed(_pp_worker, 4, cfg, weights, data, 2, 2, 1, 4, False)
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r["grads"])
        if r["last"]:
            torch.testing.assert_close(r["loss"], ref_loss, **TOL)
    assert set(merged) == set(ref_grads)
    for name, g in ref_grads.items():
        for r in results:
            if name in r["grads"]:
                torch.testing.assert_close(r["grads"][name], g, **TOL, msg=lambda s, n=name: f"{n}: {s}")


@pytest.mark.slow
def test_dp2_tp2_zero1_training_equals_single_process() -> None:
    cfg = moe_config()
    weights, batches = moe_weights(cfg), global_batches(cfg, steps=3)
    opt_cfg = dataclasses.replace(OPT, use_distributed_optimizer=True)
    ref, ref_steps, _ = reference(cfg, weights, batches, opt_cfg)
    ddp_cfg = DDPConfig(use_distributed_optimizer=True)
    for r in run_distributed(worker_pp1, 4, 2, cfg, weights, batches, ddp_cfg, opt_cfg, 2):
        assert_params_close(r["params"], ref)
        for (ok, norm), (_, ref_norm) in zip(r["steps"], ref_steps, strict=True):
            assert ok and norm == pytest.approx(ref_norm, rel=1e-5)


@pytest.mark.slow
def test_tp2_pp2_dp2_zero1_training_equals_single_process() -> None:
    cfg = moe_config(num_layers=4)
    weights, batches = moe_weights(cfg), global_batches(cfg, steps=2)
    opt_cfg = dataclasses.replace(OPT, use_distributed_optimizer=True)
    ref, _, _ = reference(cfg, weights, batches, opt_cfg)
    ddp_cfg = DDPConfig(use_distributed_optimizer=True)
    for r in run_distributed(worker_pipeline, 8, 2, 2, cfg, weights, batches, ddp_cfg, opt_cfg, 2):
        for name, v in r["params"].items():
            torch.testing.assert_close(v, ref[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
