"""LoRA on mixture-of-experts models under expert parallelism (EP; TP x EP with ETP = TP or 1; ETP 2
at TP 1):
the training steps equal one process on loss, gradient norm and every adapter (slow: processes)."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from pretrain.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads, global_loss_tokens
from pretrain.models.gpt import GPTModel
from pretrain.models.lora import LoraConfig, add_lora, is_lora_name
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.optim import build_optimizer
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from tests.distributed import run_distributed
from tests.dp_training import OPT, global_batches, local_microbatches, masked_sum_loss
from tests.test_moe_parallel import moe_config, moe_weights

LORA = LoraConfig(rank=2, alpha=4.0)
TOL = {"rtol": 1e-5, "atol": 1e-6}
# adapters after Adam steps: an element with a near-zero gradient moves by a rounding-sized
# fraction of the step (lr 2e-3); seen up to 3e-6
ADAPTER_TOL = {"rtol": 1e-5, "atol": 1e-5}


def _adapters(cfg) -> dict[str, torch.Tensor]:
    """Random full adapters (B != 0, so every A has a gradient), independent of any layout."""
    model = GPTModel(cfg, ParallelState.single())
    add_lora(model, LORA, seed=3)
    gen = torch.Generator().manual_seed(7)
    full = {k: v for k, v in gather_full_state_dict(model).items() if is_lora_name(k)}
    return {k: 0.2 * torch.randn(v.shape, generator=gen) for k, v in sorted(full.items())}


def _worker(rank: int, world: int, par: ParallelConfig, cfg, weights, adapters, batches, zero1: bool):
    """Two steps of LoRA training: per step the global loss and the gradient norm; then the full
    adapters this rank holds (its experts') and whether the frozen base stayed bitwise."""
    ps = ParallelState.from_distributed(par, seed=0)
    model = GPTModel(cfg, ps)
    load_full_state_dict(model, weights)
    add_lora(model, LORA, seed=3)
    load_full_state_dict(model, adapters, strict=False)
    ddp = DistributedDataParallel(model, ps, DDPConfig(use_distributed_optimizer=zero1))
    opt = build_optimizer(dataclasses.replace(OPT, use_distributed_optimizer=zero1), [ddp], ps)
    losses, steps = [], []
    for data in batches:
        mbs = local_microbatches(data, ps, 2)
        n_tokens = global_loss_tokens([m["loss_mask"] for m in mbs], ps)
        opt.zero_grad()
        total = torch.zeros(())
        for i, mb in enumerate(mbs):
            with ddp.no_sync() if i < len(mbs) - 1 else nullcontext():
                loss = masked_sum_loss(model(mb["tokens"], labels=mb["labels"]), mb["loss_mask"], n_tokens)
                opt.scale_loss(loss).backward()
                total += loss.detach()
        finalize_model_grads([ddp])
        if ps.dp_group is not None:
            dist.all_reduce(total, group=ps.dp_group)
        losses.append(total)
        steps.append(opt.step()[:2])
    full = gather_full_state_dict(model)
    base_same = all(torch.equal(v, weights[k]) for k, v in full.items() if not is_lora_name(k))
    return {"losses": losses, "steps": steps, "lora": {k: v for k, v in full.items() if is_lora_name(k)},
            "base_same": base_same}  # fmt: skip


LAYOUTS = {  # name: (world, layout)
    "ep2": (2, ParallelConfig(ep=2)),
    "tp2_ep2": (4, ParallelConfig(tp=2, ep=2)),
    "tp2_ep2_etp1": (4, ParallelConfig(tp=2, ep=2, etp=1)),
    "ep2_etp2": (4, ParallelConfig(ep=2, etp=2)),
}


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "zero1"), [("ep2", False), ("ep2", True), ("tp2_ep2", True),
                                                ("tp2_ep2_etp1", False), ("ep2_etp2", True)])  # fmt: skip
def test_expert_parallel_lora_training_equals_one_process(layout: str, zero1: bool) -> None:
    world, par = LAYOUTS[layout]
    cfg = moe_config(num_layers=4)  # a dense layer, a gated shared expert, 4 routed experts
    weights, adapters, batches = moe_weights(cfg), _adapters(cfg), global_batches(cfg, steps=2)
    single = ParallelState.single()
    with mock.patch.object(ParallelState, "from_distributed", lambda *a, **k: single):
        ref = _worker(0, 1, ParallelConfig(), cfg, weights, adapters, batches, False)
    results = run_distributed(_worker, world, par, cfg, weights, adapters, batches, zero1)
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        assert r["base_same"]
        for got, want in zip(r["losses"], ref["losses"], strict=True):
            torch.testing.assert_close(got, want, **TOL)
        for (ok, norm), (_, ref_norm) in zip(r["steps"], ref["steps"], strict=True):
            assert ok and norm == pytest.approx(ref_norm, rel=1e-5)
        merged.update(r["lora"])
    assert merged.keys() == ref["lora"].keys() and any(".mlp.experts.3." in k for k in merged)
    for name, want in ref["lora"].items():
        assert not torch.equal(want, adapters[name]), name  # every adapter trained
        torch.testing.assert_close(merged[name], want, **ADAPTER_TOL, msg=lambda m, n=name: f"{n}: {m}")
