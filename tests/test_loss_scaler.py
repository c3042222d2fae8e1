"""Loss scaling: growth, backoff, hysteresis, minimum; skipped steps change nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.distributed import DDPConfig, finalize_model_grads, global_loss_tokens
from pretrain.models.sharding import gather_full_state_dict
from pretrain.optim import ConstantLossScaler, DynamicLossScaler, OptimizerConfig, build_loss_scaler
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from pretrain.utils.errors import UserError
from tests.distributed import run_distributed
from tests.dp_training import OPT, build, global_batches, local_microbatches, masked_sum_loss
from tests.gpt_fixtures import full_weights, tiny_config


def test_growth_after_window_of_clean_steps() -> None:
    s = DynamicLossScaler(initial_scale=8.0, growth_interval=3, hysteresis=2)
    for _ in range(2):
        s.update(False)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 16.0 and s.growth_tracker == 0


def test_backoff_after_hysteresis_overflows_and_min_scale() -> None:
    s = DynamicLossScaler(initial_scale=8.0, min_scale=2.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 8.0 and s.hysteresis_tracker == 1  # first overflow tolerated
    s.update(True)
    assert s.scale == 4.0
    s.update(True)  # hysteresis exhausted: every further overflow backs off ...
    assert s.scale == 2.0
    s.update(True)
    assert s.scale == 2.0  # ... but never below min_scale
    s.update(False)
    s.update(True)  # a clean step resets the growth counter, not the hysteresis
    assert s.growth_tracker == 0 and s.scale == 2.0


def test_overflow_resets_growth_and_growth_refills_hysteresis() -> None:
    s = DynamicLossScaler(initial_scale=8.0, growth_interval=2, hysteresis=2)
    s.update(False)
    s.update(True)  # resets growth tracker
    assert s.growth_tracker == 0 and s.hysteresis_tracker == 1 and s.scale == 8.0
    s.update(False)
    s.update(False)
    assert s.scale == 16.0 and s.hysteresis_tracker == 2
    state = s.state_dict()
    t = DynamicLossScaler(initial_scale=1.0)
    t.load_state_dict(state)
    assert t.state_dict() == state


def test_constant_scaler_and_builder() -> None:
    c = ConstantLossScaler(128.0)
    c.update(True)
    assert c.scale == 128.0
    assert build_loss_scaler(OptimizerConfig()) is None
    assert build_loss_scaler(OptimizerConfig(bf16=True)) is None
    assert isinstance(build_loss_scaler(OptimizerConfig(fp16=True)), DynamicLossScaler)
    assert isinstance(build_loss_scaler(OptimizerConfig(fp16=True, loss_scale=4.0)), ConstantLossScaler)
    assert build_loss_scaler(OptimizerConfig(fp16=True)).scale == 2.0**32
    with pytest.raises(UserError, match="fp16"):
        OptimizerConfig(fp16=True, bf16=True)


def _snapshot(opt) -> list[torch.Tensor]:
    out = [m.main.detach().clone() for m in opt.mains]
    for st in opt.adam.state.values():
        out += [t.detach().clone() for t in st.values()]
    return out


def _inject_inf_and_step(rank: int, world: int, distributed: bool, cfg, weights, batches):
    """Step 1 clean, step 2 with an inf gradient on rank 1 only, step 3 clean."""
    ps = ParallelState.from_distributed(ParallelConfig(tp=1), seed=0)
    opt_cfg = dataclasses.replace(OPT, use_distributed_optimizer=distributed, loss_scale=None)
    model, ddp, opt = build(ps, cfg, weights, DDPConfig(use_distributed_optimizer=distributed), opt_cfg)
    opt.scaler = DynamicLossScaler(initial_scale=1024.0, hysteresis=2, growth_interval=1000)
    log = []
    for i, data in enumerate(batches):
        (mb,) = local_microbatches(data, ps, 1)
        n = global_loss_tokens([mb["loss_mask"]], ps)
        opt.zero_grad()
        opt.scale_loss(
            masked_sum_loss(model(mb["tokens"], labels=mb["labels"]), mb["loss_mask"], n)
        ).backward()
        if i == 1 and rank == 1:  # a single non-finite element on a single rank
            next(model.parameters()).main_grad.view(-1)[3] = float("inf")
        finalize_model_grads([ddp])
        before_params, before_state = gather_full_state_dict(model), _snapshot(opt)
        ok, norm, _ = opt.step()
        after_params, after_state = gather_full_state_dict(model), _snapshot(opt)
        unchanged = all(torch.equal(before_params[k], after_params[k]) for k in before_params) and all(
            torch.equal(a, b) for a, b in zip(before_state, after_state, strict=True)
        )
        log.append(
            {
                "ok": ok,
                "norm": norm,
                "unchanged": unchanged,
                "scale": opt.loss_scale,
                "step": opt.adam_step_count(),
            }
        )
    return log


@pytest.mark.slow
@pytest.mark.parametrize("distributed", [False, True])
def test_injected_inf_skips_step_on_every_rank(distributed: bool) -> None:
    cfg = tiny_config()
    weights, batches = full_weights(cfg), global_batches(cfg, steps=3)
    for log in run_distributed(_inject_inf_and_step, 2, distributed, cfg, weights, batches):
        assert [e["ok"] for e in log] == [True, False, True]
        assert [e["unchanged"] for e in log] == [False, True, False]
        assert log[1]["norm"] is None
        assert [e["step"] for e in log] == [1, 1, 2]
        assert [e["scale"] for e in log] == [1024.0, 1024.0, 1024.0]  # hysteresis 2: no backoff yet


def test_fp16_training_backs_off_until_finite_and_keeps_fp32_main_params() -> None:
    cfg = tiny_config(params_dtype="float16")
    weights, batches = full_weights(tiny_config()), global_batches(cfg, steps=1) * 14
    opt_cfg = dataclasses.replace(OPT, fp16=True, initial_loss_scale=2.0**20, hysteresis=1)
    ps = ParallelState.single()
    model, ddp, opt = build(ps, cfg, weights, DDPConfig(grad_reduce_in_fp32=False), opt_cfg)
    assert ddp.buffers[0].grad_dtype == torch.float16
    assert all(m.copies_grad and m.copies_param and m.main.dtype == torch.float32 for m in opt.mains)
    scales, oks = [], []
    for data in batches:
        n = global_loss_tokens([data["loss_mask"]], ps)
        opt.zero_grad()
        losses = model(data["tokens"], labels=data["labels"])
        opt.scale_loss(masked_sum_loss(losses, data["loss_mask"], n)).backward()
        finalize_model_grads([ddp])
        before = [p.detach().clone() for p in model.parameters()]
        ok, _, _ = opt.step()
        changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        assert changed == ok
        scales.append(opt.loss_scale)
        oks.append(ok)
    assert not oks[0] and sum(oks) >= 5, (oks, scales)
    previous = 2.0**20
    for ok, scale in zip(oks, scales, strict=True):  # halves on every overflow (hysteresis 1)
        assert scale == (previous if ok else previous / 2)
        previous = scale
    assert opt.adam_step_count() == sum(oks)
