"""Router losses and token dropping equal megatron-core's functions, and training injects their
gradients as megatron-core's ``MoEAuxLossAutoScaler`` does, the same on every layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.models.gpt import GPTModel
from pretrain.models.moe.capacity import expert_capacity, keep_mask
from pretrain.models.moe.layer import MoEMLP, set_aux_loss_scale
from pretrain.models.moe.losses import load_balancing_loss, z_loss
from pretrain.models.moe.router import route
from pretrain.models.sharding import load_full_state_dict
from pretrain.parallel.state import ParallelState
from tests.distributed import run_distributed
from tests.gpt_fixtures import batch
from tests.test_moe_parallel import moe_config, moe_weights

E, K = 6, 2


def _logits(tokens: int = 40, seed: int = 0) -> torch.Tensor:
    return 3.0 * torch.randn(tokens, E, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_load_balancing_and_z_loss_equal_megatron_core(score: str) -> None:
    mu = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    logits = _logits()
    routed, scores = mu.compute_routing_scores_for_aux_loss(logits, K, score)
    want = mu.switch_load_balancing_loss_func(
        probs=scores, tokens_per_expert=routed.sum(0), total_num_tokens=logits.shape[0], topk=K,
        num_experts=E, moe_aux_loss_coeff=0.01,
    )  # fmt: skip
    got = load_balancing_loss(logits, topk=K, score_function=score, coeff=0.01)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(z_loss(logits, coeff=1e-3), mu.z_loss_func(logits, 1e-3), rtol=1e-6, atol=0)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5])
def test_token_dropping_equals_megatron_core(policy: str, factor: float) -> None:
    mu = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    logits = _logits(seed=3)
    logits[:, 0] += 4.0  # an overloaded expert
    want_probs, want_map = mu.topk_routing_with_score_function(logits, K, score_function="softmax")
    want_probs, want_map = mu.apply_router_token_dropping(want_probs, want_map, router_topk=K,
                                                          capacity_factor=factor, drop_policy=policy)  # fmt: skip
    probs, experts = route(logits, topk=K, pre_softmax=False, score_function="softmax")
    keep = keep_mask(probs, experts, num_experts=E, factor=factor, policy=policy)
    got_map = torch.zeros(logits.shape, dtype=torch.bool).scatter(1, experts, keep)
    assert torch.equal(got_map, want_map)
    torch.testing.assert_close(torch.zeros_like(logits).scatter(1, experts, probs * keep), want_probs)
    if factor < 1.0:
        assert int(got_map.sum(0).max()) == expert_capacity(40, topk=K, experts=E, factor=factor)
        assert int((~keep).sum()) > 0


def _grads(cfg, weights, data) -> dict[str, torch.Tensor]:
    """One process, one microbatch (aux-loss scale 1): every parameter's gradient."""
    model = GPTModel(cfg, ParallelState.single())
    load_full_state_dict(model, weights)
    model.train()
    set_aux_loss_scale([model], 1.0)
    losses = model(data["tokens"], labels=data["labels"])
    ((losses * data["loss_mask"]).sum() / data["loss_mask"].sum()).backward()
    return {
        model.canonical_name(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _hand_router_losses(model: GPTModel, cfg, data) -> torch.Tensor:
    """The router losses of every MoE layer, from logits captured by hooks on a second forward."""
    logits: list[torch.Tensor] = []
    hooks = [m.router.register_forward_hook(lambda mod, inp, out: logits.append(out.logits))
             for m in model.modules() if isinstance(m, MoEMLP)]  # fmt: skip
    model(data["tokens"], labels=data["labels"])
    for h in hooks:
        h.remove()
    total = torch.zeros(())
    for lg in logits:
        total = total + load_balancing_loss(lg, topk=cfg.moe_router_topk, score_function="softmax",
                                            coeff=cfg.moe_aux_loss_coeff)  # fmt: skip
        total = total + z_loss(lg, coeff=cfg.moe_z_loss_coeff)
    return total


def test_injected_router_loss_gradient_equals_adding_the_loss() -> None:
    cfg = moe_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    weights, data = moe_weights(cfg), batch(cfg)
    got = _grads(cfg, weights, data)
    plain = _grads(dataclasses.replace(cfg, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None), weights, data)
    router = "language_model.encoder.layers.0.mlp.router.weight"
    assert not torch.allclose(got[router], plain[router])  # the losses reach the router
    model = GPTModel(cfg, ParallelState.single())
    load_full_state_dict(model, weights)
    model.train()
    for m in model.modules():
        if isinstance(m, MoEMLP):
            m.aux_loss_scale = 0.0  # no injection: the hand-added losses carry the gradient
    losses = model(data["tokens"], labels=data["labels"])
    loss = (losses * data["loss_mask"]).sum() / data["loss_mask"].sum() + _hand_router_losses(
        model, cfg, data
    )
    loss.backward()
    for n, p in model.named_parameters():
        name = model.canonical_name(n)
        torch.testing.assert_close(p.grad, got[name], rtol=1e-5, atol=1e-7, msg=lambda m, k=name: f"{k}: {m}")
    stats = next(m.stats for m in model.modules() if isinstance(m, MoEMLP))
    assert stats.forwards == 2 and float(stats.tokens_per_expert.sum()) > 0


def _dp_worker(rank: int, world: int, cfg, weights, data, micro: int):
    from pretrain.parallel.config import ParallelConfig
    from pretrain.pipeline.schedules import forward_backward

    ps = ParallelState.from_distributed(ParallelConfig(tp=1, pp=1), seed=0)
    model = GPTModel(cfg, ps)
    load_full_state_dict(model, weights)
    model.train()
    rows = data["tokens"].shape[0] // world
    local = {k: v[rank * rows : (rank + 1) * rows] for k, v in data.items()}
    n = float(data["loss_mask"].sum())
    mbs = [{k: v[i::micro] for k, v in local.items()} for i in range(micro)]
    forward_backward(chunks=[model], ps=ps, microbatches=mbs,
                     loss_fn=lambda out, mb: (out * mb["loss_mask"]).sum() / n)  # fmt: skip
    grads = {model.canonical_name(k): p.grad for k, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():
        torch.distributed.all_reduce(g)
    return grads


def _one_process_two_micro(cfg, weights, data) -> dict[str, torch.Tensor]:
    from pretrain.pipeline.schedules import forward_backward

    model = GPTModel(cfg, ParallelState.single())
    load_full_state_dict(model, weights)
    model.train()
    n = float(data["loss_mask"].sum())
    mbs = [{k: v[0:2] for k, v in data.items()}, {k: v[2:4] for k, v in data.items()}]
    forward_backward(chunks=[model], ps=ParallelState.single(), microbatches=mbs,
                     loss_fn=lambda out, mb: (out * mb["loss_mask"]).sum() / n)  # fmt: skip
    return {model.canonical_name(k): p.grad for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
def test_router_losses_dp2_equal_one_process_with_the_same_microbatches() -> None:
    """Megatron's aux loss is per microbatch and averaged over microbatches x DP: two DP ranks of
    one microbatch each equal one process running the same two microbatches."""
    cfg = moe_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    weights, data = moe_weights(cfg), batch(cfg, b=4)
    one = _one_process_two_micro(cfg, weights, data)
    plain = _one_process_two_micro(
        dataclasses.replace(cfg, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None), weights, data
    )
    router = "language_model.encoder.layers.0.mlp.router.weight"
    assert not torch.allclose(one[router], plain[router])
    for r in run_distributed(_dp_worker, 2, cfg, weights, data, 1):
        for name, g in one.items():
            torch.testing.assert_close(r[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, k=name: f"{k}: {m}")
