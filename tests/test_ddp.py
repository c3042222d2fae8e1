"""Data parallelism with contiguous grad buffers: dp / tp x dp (x pp) training equals one process."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.distributed import DDPConfig, DistributedDataParallel, GradBuffer
from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.optim.param_groups import uses_weight_decay
from pretrain.parallel.state import ParallelState
from tests.distributed import run_distributed
from tests.dp_training import (
    HAS_PIPELINE,
    OPT,
    assert_params_close,
    global_batches,
    reference,
    worker_pipeline,
    worker_pp1,
)
from tests.gpt_fixtures import full_weights, tiny_config

STEPS = 3


def test_grad_buffer_layout_reverse_order_padding_and_views() -> None:
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 7, 3, 10)]
    buf = GradBuffer(params, grad_dtype=torch.float32, dp_size=4, bucket_size=9, shard_alignment=2)
    # Reverse order: the last parameter starts the buffer.
    ranges = [(buf.index[id(p)].start, buf.index[id(p)].end) for p in params]
    assert ranges == [(32, 37), (19, 26), (16, 19), (0, 10)]
    assert [(b.start, b.end) for b in buf.buckets] == [(0, 16), (16, 32), (32, 40)]  # 10 | 3+7 | 5
    for b in buf.buckets:
        assert b.size % 8 == 0  # divisible by dp_size * shard_alignment
    assert buf.numel == sum(b.size for b in buf.buckets) and buf.numel % 4 == 0
    for p in params:
        r = buf.index[id(p)]
        assert p.main_grad.data_ptr() == buf.grad_data[r.start :].data_ptr()
        assert p.main_grad.shape == p.shape


def test_hooks_accumulate_bf16_grads_in_fp32_and_free_grad() -> None:
    ps = ParallelState.single()
    lin = torch.nn.Linear(4, 3, dtype=torch.bfloat16)
    ddp = DistributedDataParallel(lin, ps, DDPConfig())
    assert ddp.buffers[0].grad_dtype == torch.float32
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    ddp.zero_grad_buffer()
    expected = torch.zeros(3, 4)
    for _ in range(3):
        lin.zero_grad()
        ref = torch.nn.Linear(4, 3, dtype=torch.bfloat16)
        ref.load_state_dict(lin.state_dict())
        ref(x).square().sum().backward()
        expected += ref.weight.grad.float()
        ddp(x).square().sum().backward()
        assert lin.weight.grad is None and lin.bias.grad is None
    torch.testing.assert_close(lin.weight.main_grad, expected)
    assert lin.weight.main_grad.dtype == torch.float32


def test_single_process_optimizer_matches_torch_adamw_with_clipping() -> None:
    cfg = tiny_config()
    weights, batches = full_weights(cfg), global_batches(cfg, steps=STEPS)
    ours, steps, _ = reference(cfg, weights, batches, OPT)
    model = GPTModel(cfg, ParallelState.single())
    load_full_state_dict(model, weights)
    named = list(model.named_parameters())
    adam = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if uses_weight_decay(n, p)], "weight_decay": OPT.weight_decay},
            {"params": [p for n, p in named if not uses_weight_decay(n, p)], "weight_decay": 0.0},
        ],
        lr=OPT.lr,
        betas=(OPT.adam_beta1, OPT.adam_beta2),
        eps=OPT.adam_eps,
    )
    for data, (ok, norm) in zip(batches, steps, strict=True):
        adam.zero_grad()
        losses = model(data["tokens"], labels=data["labels"])
        ((losses * data["loss_mask"]).sum() / data["loss_mask"].sum()).backward()
        torch_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPT.clip_grad)
        assert ok and norm == pytest.approx(float(torch_norm), rel=1e-5)
        assert float(torch_norm) > OPT.clip_grad  # clipping is exercised
        adam.step()
    assert_params_close(ours, gather_full_state_dict(model))


LAYOUTS = [(4, 1), (4, 2)]  # (world, tp): dp=4 alone, tp=2 x dp=2


@pytest.mark.slow
@pytest.mark.parametrize("world,tp", LAYOUTS)
@pytest.mark.parametrize("distributed", [False, True])
def test_data_parallel_training_equals_single_process(world: int, tp: int, distributed: bool) -> None:
    cfg = tiny_config()
    weights, batches = full_weights(cfg), global_batches(cfg, steps=STEPS)
    opt_cfg = dataclasses.replace(OPT, use_distributed_optimizer=distributed)
    ref, ref_steps, _ = reference(cfg, weights, batches, opt_cfg)
    ddp_cfg = DDPConfig(use_distributed_optimizer=distributed)
    results = run_distributed(worker_pp1, world, tp, cfg, weights, batches, ddp_cfg, opt_cfg, 2)
    for r in results:
        assert_params_close(r["params"], ref)
        for (ok, norm), (_, ref_norm) in zip(r["steps"], ref_steps, strict=True):
            assert ok and norm == pytest.approx(ref_norm, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("distributed", [False, True])
def test_overlapped_bucketed_reduction_equals_single_process(distributed: bool) -> None:
    cfg = tiny_config()
    weights, batches = full_weights(cfg), global_batches(cfg, steps=2)
    opt_cfg = dataclasses.replace(OPT, use_distributed_optimizer=distributed)
    ref, _, _ = reference(cfg, weights, batches, opt_cfg)
    ddp_cfg = DDPConfig(
        overlap_grad_reduce=True, bucket_size=6000, shard_alignment=4, use_distributed_optimizer=distributed
    )
    results = run_distributed(worker_pp1, 2, 1, cfg, weights, batches, ddp_cfg, opt_cfg, 2)
    for r in results:
        assert_params_close(r["params"], ref)


def test_overlap_without_no_sync_is_an_error() -> None:
    ps = ParallelState.single()
    lin = torch.nn.Linear(4, 3)
    ddp = DistributedDataParallel(lin, ps, DDPConfig(overlap_grad_reduce=True))
    ddp.zero_grad_buffer()
    ddp(torch.randn(2, 4)).sum().backward()  # bucket complete: launched (a no-op at dp=1)
    with pytest.raises(RuntimeError, match="no_sync"):
        ddp(torch.randn(2, 4)).sum().backward()


def test_bf16_params_train_close_to_fp32_and_keep_fp32_main_params() -> None:
    cfg32 = tiny_config()
    cfg16 = tiny_config(params_dtype="bfloat16")
    weights, batches = full_weights(cfg32), global_batches(cfg32, steps=STEPS)
    ref, _, _ = reference(cfg32, weights, batches, OPT)
    bf16_opt = dataclasses.replace(OPT, bf16=True)
    got, steps, opt = reference(cfg16, weights, batches, bf16_opt)
    assert all(ok for ok, _ in steps)
    assert all(m.main.dtype == torch.float32 and m.copies_param for m in opt.mains)
    assert all(m.model_param.dtype == torch.bfloat16 and not m.copies_grad for m in opt.mains)
    # The fp32 main params equal the bf16 model params up to bf16 rounding, but keep more bits.
    m0 = opt.mains[0]
    torch.testing.assert_close(m0.main.to(torch.bfloat16), m0.model_param.detach(), rtol=0, atol=0)
    assert not torch.equal(m0.main, m0.main.to(torch.bfloat16).float())
    # Training moves the fp32 main params like fp32 training does: the updates agree to a few %.
    mains = {k.removeprefix("model0."): v["param"] for k, v in opt.full_state().items()}
    num = den = 0.0
    for name, v in ref.items():
        main = mains[name][: v.shape[0]] if "word_embeddings" in name else mains[name]
        num += float((main - v).square().sum())
        den += float((v - weights[name]).square().sum())
        torch.testing.assert_close(got[name].float(), v, rtol=0.05, atol=1e-2)
    assert (num / den) ** 0.5 < 0.08, (num / den) ** 0.5


@pytest.mark.slow
@pytest.mark.skipif(not HAS_PIPELINE, reason="pretrain.pipeline (pipeline parallelism) is not there yet")
@pytest.mark.parametrize("distributed,overlap", [(False, False), (True, False), (True, True)])
def test_tp2_pp2_dp2_training_equals_single_process(distributed: bool, overlap: bool) -> None:
    cfg = tiny_config()
    weights, batches = full_weights(cfg), global_batches(cfg, steps=STEPS)
    opt_cfg = dataclasses.replace(OPT, use_distributed_optimizer=distributed)
    ref, ref_steps, _ = reference(cfg, weights, batches, opt_cfg)
    # With overlap, small buckets are reduced during backward; the tied-embedding bucket is held
    # back for the embedding all-reduce (it must precede the reduce-scatter).
    ddp_cfg = DDPConfig(
        use_distributed_optimizer=distributed,
        overlap_grad_reduce=overlap,
        bucket_size=4000 if overlap else None,
        shard_alignment=4,
    )
    results = run_distributed(worker_pipeline, 8, 2, 2, cfg, weights, batches, ddp_cfg, opt_cfg, 2)
    for dp in range(2):
        merged: dict[str, torch.Tensor] = {}
        for r in results:
            if r["dp_rank"] != dp:
                continue
            for k, v in r["params"].items():
                if k in merged:  # TP ranks agree; the head copy equals the first stage's embedding
                    torch.testing.assert_close(v, merged[k], rtol=0, atol=0)
                merged[k] = v
        assert_params_close(merged, ref)
    for r in results:
        for (ok, norm), (_, ref_norm) in zip(r["steps"], ref_steps, strict=True):
            assert ok and norm == pytest.approx(ref_norm, rel=1e-5)
