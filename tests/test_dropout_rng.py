"""Model-parallel RNG: reproducible dropout, per-TP-rank masks inside TP regions, checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.rng import RNGStatesTracker, model_parallel_seed
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.cross_entropy import masked_mean
from tests.distributed import run_distributed
from tests.gpt_fixtures import batch, full_weights, tiny_config


def _masks(rank: int, world: int):
    ps = ParallelState.from_distributed(ParallelConfig(tp=world), seed=123)
    outside = F.dropout(torch.ones(4096), 0.5)
    with ps.rng.fork():
        inside = F.dropout(torch.ones(4096), 0.5)
    after = F.dropout(torch.ones(4096), 0.5)  # the fork must not have advanced the default stream
    return {"outside": outside, "inside": inside, "after": after}


@pytest.mark.slow
def test_masks_same_outside_and_different_inside_tp_regions() -> None:
    r0, r1 = run_distributed(_masks, 2)
    assert torch.equal(r0["outside"], r1["outside"])
    assert torch.equal(r0["after"], r1["after"])
    assert not torch.equal(r0["inside"], r1["inside"])
    assert 0.4 < (r0["inside"] == 0).float().mean() < 0.6


def test_fork_does_not_disturb_default_stream() -> None:
    tracker = RNGStatesTracker()
    model_parallel_seed(tracker, 5, tp_rank=0, pp_rank=0)
    a = torch.rand(8)
    with tracker.fork():
        torch.rand(100)
    b = torch.rand(8)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(8), a) and torch.equal(torch.rand(8), b)


def _run(cfg, weights, data, *, seed: int, ps: ParallelState):
    ps.seed(seed)
    model = GPTModel(cfg, ps)
    load_full_state_dict(model, weights)
    model.train()
    loss = masked_mean(model(data["tokens"], labels=data["labels"]), data["loss_mask"])
    loss.backward()
    return loss.detach(), gather_full_state_dict(model, grads=True)


def test_same_seed_same_run_and_dropout_active() -> None:
    cfg = tiny_config(hidden_dropout=0.1, attention_dropout=0.1)
    weights, data = full_weights(cfg), batch(cfg)
    l1, g1 = _run(cfg, weights, data, seed=9, ps=ParallelState.single())
    l2, g2 = _run(cfg, weights, data, seed=9, ps=ParallelState.single())
    l3, _ = _run(cfg, weights, data, seed=10, ps=ParallelState.single())
    assert torch.equal(l1, l2) and all(torch.equal(g1[k], g2[k]) for k in g1)
    assert not torch.equal(l1, l3)


def _ckpt_vs_plain(rank: int, world: int, cfg, weights, data):
    from dataclasses import replace

    out = []
    for recompute in (False, True):
        ps = ParallelState.from_distributed(ParallelConfig(tp=world))
        out.append(_run(replace(cfg, recompute_activations=recompute), weights, data, seed=11, ps=ps))
    return out


@pytest.mark.slow
def test_checkpointed_layers_give_identical_gradients_with_dropout() -> None:
    cfg = tiny_config(hidden_dropout=0.2, attention_dropout=0.2)
    weights, data = full_weights(cfg), batch(cfg)
    for world in (1, 2):
        for (plain_loss, plain), (ck_loss, ck) in run_distributed(_ckpt_vs_plain, world, cfg, weights, data):
            assert torch.equal(plain_loss, ck_loss)
            for k in plain:
                assert torch.equal(plain[k], ck[k]), k
