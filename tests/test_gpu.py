"""The CUDA/NCCL lane (``pytest -m gpu``, ``make test-gpu``): the CPU equivalence specs on GPUs.

Every test here is skipped without CUDA. Each reuses a CPU harness (``tests.gpt_fixtures``,
``tests.dp_training``) with ``device="cuda"`` and, for several ranks, NCCL instead of gloo:

* one GPU: our GPT on CUDA computes the same logits, loss and gradients as on the CPU; bf16
  and fp16 (dynamic loss scaling) training on CUDA keep fp32 main parameters and track fp32;
* several GPUs (one rank per GPU, NCCL cannot put two ranks on one device): TP, PP (with
  interleaving) and DP with the distributed optimizer equal the single-process CPU reference.

TF32 is switched off so fp32 on the GPU is fp32; tolerances allow for reordered reductions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pretrain.distributed import DDPConfig, finalize_model_grads, global_loss_tokens
from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.cross_entropy import masked_mean
from tests.distributed import run_distributed, to_device
from tests.dp_training import OPT, build, global_batches, masked_sum_loss, reference, train_pp1
from tests.gpt_fixtures import batch, full_weights, single_process_reference, tiny_config

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (the pytest -m gpu lane)")]
GPU_TOL = {"rtol": 1e-4, "atol": 1e-5}


def needs_gpus(n: int) -> pytest.MarkDecorator:
    count = torch.cuda.device_count() if HAS_CUDA else 0
    return pytest.mark.skipif(count < n, reason=f"needs {n} GPUs (one NCCL rank per GPU), found {count}")


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    if HAS_CUDA:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def run_nccl(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``run_distributed`` with NCCL, rank r on GPU r (spawned: CUDA cannot fork)."""
    return run_distributed(fn, world_size, *args, backend="nccl", start_method="spawn", timeout=300.0)


def _cuda_state(config: ParallelConfig) -> ParallelState:
    return ParallelState.from_distributed(config, device=f"cuda:{dist.get_rank()}", seed=0)


# --- one GPU ------------------------------------------------------------------------------------
def test_cuda_forward_backward_equals_cpu() -> None:
    cfg = tiny_config()
    weights, data = full_weights(cfg), batch(cfg)
    ref_logits, ref_loss, ref_grads = single_process_reference(cfg, weights, data)
    model = GPTModel(cfg, ParallelState.single(device="cuda", seed=0))
    load_full_state_dict(model, weights)
    gpu = to_device(data, "cuda")
    logits = model.full_logits(model(gpu["tokens"]))
    loss = masked_mean(model(gpu["tokens"], labels=gpu["labels"]), gpu["loss_mask"])
    loss.backward()
    assert logits.is_cuda
    torch.testing.assert_close(logits.cpu(), ref_logits, **GPU_TOL)
    torch.testing.assert_close(loss.cpu(), ref_loss, **GPU_TOL)
    for name, g in gather_full_state_dict(model, grads=True).items():
        torch.testing.assert_close(g.cpu(), ref_grads[name], **GPU_TOL, msg=lambda m, n=name: f"{n}: {m}")


def _train_on_cuda(cfg, weights, batches, opt_cfg, ddp_cfg: DDPConfig):
    ps = ParallelState.single(device="cuda", seed=0)
    model, ddp, opt = build(ps, cfg, weights, ddp_cfg, opt_cfg)
    steps = train_pp1(ps, model, ddp, opt, to_device(batches, "cuda"), num_micro=1)
    return to_device(gather_full_state_dict(model), "cpu"), steps, opt


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_training_on_cuda_tracks_fp32(precision: str) -> None:
    """bf16 / fp16 parameters on the GPU: fp32 main params, finite steps, updates close to fp32."""
    cfg32 = tiny_config()
    dtype = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    cfg16 = tiny_config(params_dtype=dtype)
    weights, batches = full_weights(cfg32), global_batches(cfg32, steps=3)
    ref, _, _ = reference(cfg32, weights, batches, OPT)
    opt_cfg = dataclasses.replace(
        OPT, **{precision: True}, **({"loss_scale": 1024.0} if precision == "fp16" else {})
    )
    ddp_cfg = DDPConfig(grad_reduce_in_fp32=precision == "bf16")
    got, steps, opt = _train_on_cuda(cfg16, weights, batches, opt_cfg, ddp_cfg)
    assert all(ok for ok, _ in steps)
    assert all(m.main.dtype == torch.float32 and m.main.is_cuda for m in opt.mains)
    num = den = 0.0
    for name, v in ref.items():
        assert got[name].dtype == getattr(torch, dtype)
        num += float((got[name].float() - v).square().sum())
        den += float((v - weights[name]).square().sum())
    assert (num / den) ** 0.5 < 0.15, (num / den) ** 0.5  # half-precision rounding of small updates


def test_fp16_dynamic_loss_scale_backs_off_on_cuda() -> None:
    cfg = tiny_config(params_dtype="float16")
    weights, data = full_weights(tiny_config()), batch(cfg, seed=100)
    opt_cfg = dataclasses.replace(OPT, fp16=True, initial_loss_scale=2.0**20, hysteresis=1)
    ps = ParallelState.single(device="cuda", seed=0)
    model, ddp, opt = build(ps, cfg, weights, DDPConfig(grad_reduce_in_fp32=False), opt_cfg)
    gpu, oks = to_device(data, "cuda"), []
    for _ in range(14):
        n = global_loss_tokens([gpu["loss_mask"]], ps)
        opt.zero_grad()
        losses = model(gpu["tokens"], labels=gpu["labels"])
        opt.scale_loss(masked_sum_loss(losses, gpu["loss_mask"], n)).backward()
        finalize_model_grads([ddp])
        oks.append(opt.step()[0])
    assert not oks[0] and sum(oks) >= 5 and opt.loss_scale < 2.0**20, oks


# --- several GPUs under NCCL ------------------------------------------------------------------------
def _tp_step(rank: int, world: int, cfg, weights, data):
    model = GPTModel(cfg, _cuda_state(ParallelConfig(tp=world)))
    load_full_state_dict(model, weights)
    gpu = to_device(data, model.ps.device)
    loss = masked_mean(model(gpu["tokens"], labels=gpu["labels"]), gpu["loss_mask"])
    loss.backward()
    return {"loss": loss.detach(), "grads": gather_full_state_dict(model, grads=True)}


@needs_gpus(2)
def test_tensor_parallel_nccl_equals_single_process() -> None:
    cfg = tiny_config(num_attention_heads=8)
    weights, data = full_weights(cfg), batch(cfg)
    _, ref_loss, ref_grads = single_process_reference(cfg, weights, data)
    for r in run_nccl(_tp_step, 2, cfg, weights, data):
        torch.testing.assert_close(r["loss"], ref_loss, **GPU_TOL)
        for name, g in ref_grads.items():
            torch.testing.assert_close(r["grads"][name], g, **GPU_TOL, msg=lambda m, n=name: f"{n}: {m}")


def _pp_step(rank: int, world: int, cfg, weights, data, vp: int):
    from pretrain.pipeline.embedding_sync import allreduce_embedding_grads
    from pretrain.pipeline.partition import build_model_chunks
    from pretrain.pipeline.schedules import forward_backward

    ps = _cuda_state(ParallelConfig(pp=world, vp=vp))
    chunks = build_model_chunks(cfg, ps)
    for chunk in chunks:
        load_full_state_dict(chunk, weights)
    gpu = to_device(data, ps.device)
    total = gpu["loss_mask"].sum()
    micro = [dict(zip(gpu, parts)) for parts in zip(*(t.chunk(4) for t in gpu.values()))]
    losses, _ = forward_backward(
        chunks=chunks, ps=ps, microbatches=micro, loss_fn=lambda out, mb: (out * mb["loss_mask"]).sum() / total,
        finalize_grads=lambda: allreduce_embedding_grads(chunks, ps),
    )  # fmt: skip
    grads: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        grads.update(gather_full_state_dict(chunk, grads=True))
    return {"last": ps.is_last_stage, "loss": torch.stack(losses).sum() if losses else None, "grads": grads}


@needs_gpus(2)
@pytest.mark.parametrize("vp", [1, 2])
def test_pipeline_nccl_equals_single_process(vp: int) -> None:
    cfg = tiny_config(num_layers=8, num_attention_heads=4)
    weights, data = full_weights(cfg), batch(cfg, b=8, s=8)
    _, ref_loss, ref_grads = single_process_reference(cfg, weights, data)
    results = run_nccl(_pp_step, 2, cfg, weights, data, vp)
    torch.testing.assert_close(next(r["loss"] for r in results if r["last"]), ref_loss, **GPU_TOL)
    for name, g in ref_grads.items():
        for r in (r for r in results if name in r["grads"]):
            torch.testing.assert_close(r["grads"][name], g, **GPU_TOL, msg=lambda m, n=name: f"{n}: {m}")


def _dp_train(rank: int, world: int, tp: int, cfg, weights, batches, opt_cfg):
    ps = _cuda_state(ParallelConfig(tp=tp))
    ddp_cfg = DDPConfig(use_distributed_optimizer=opt_cfg.use_distributed_optimizer)
    model, ddp, opt = build(ps, cfg, weights, ddp_cfg, opt_cfg)
    steps = train_pp1(ps, model, ddp, opt, to_device(batches, ps.device), num_micro=2)
    return {"params": gather_full_state_dict(model), "norms": [norm for _, norm in steps]}


@pytest.mark.parametrize(("world", "tp"), [(2, 1), (4, 2)])
@pytest.mark.parametrize("distributed", [False, True])
def test_data_parallel_nccl_equals_single_process(world: int, tp: int, distributed: bool) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs (one NCCL rank per GPU)")
    cfg = tiny_config()
    weights, batches = full_weights(cfg), global_batches(cfg, steps=3)
    opt_cfg = dataclasses.replace(OPT, use_distributed_optimizer=distributed)
    ref, ref_steps, _ = reference(cfg, weights, batches, opt_cfg)
    for r in run_nccl(_dp_train, world, tp, cfg, weights, batches, opt_cfg):
        for name, v in ref.items():
            torch.testing.assert_close(r["params"][name], v, **GPU_TOL, msg=lambda m, n=name: f"{n}: {m}")
        assert r["norms"] == pytest.approx([n for _, n in ref_steps], rel=1e-4)
