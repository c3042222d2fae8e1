"""Shared training loop for the data-parallel / optimizer tests (pp = 1 and, when the pipeline
package exists, pp > 1): several optimizer steps on global batches, returning full parameters."""

from __future__ import annotations

import dataclasses
import importlib.util
from contextlib import nullcontext
from typing import Any

import torch

from pretrain.config import ModelConfig
from pretrain.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads, global_loss_tokens
from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.optim import OptimizerConfig, build_optimizer
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from tests.gpt_fixtures import batch

HAS_PIPELINE = importlib.util.find_spec("pretrain.pipeline") is not None
# adam_eps 1e-5: the key bias's gradient is mathematically zero (softmax ignores a per-query
# constant), so it is pure round-off noise that Adam with eps 1e-8 would blow up to lr-sized,
# layout-dependent updates. Real gradients here are ~1e-4..1e-2, far above eps.
OPT = OptimizerConfig(lr=2e-3, weight_decay=0.01, clip_grad=0.5, adam_eps=1e-5)
FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}


def global_batches(cfg: ModelConfig, *, steps: int, b: int = 8, s: int = 16) -> list[dict[str, torch.Tensor]]:
    return [batch(cfg, b=b, s=s, seed=100 + i) for i in range(steps)]


def local_microbatches(
    data: dict[str, torch.Tensor], ps: ParallelState, num_micro: int
) -> list[dict[str, Any]]:
    """This DP rank's contiguous rows of the global batch, cut into ``num_micro`` microbatches."""
    rows = data["tokens"].shape[0] // ps.dp_size
    local = {k: v[ps.dp_rank * rows : (ps.dp_rank + 1) * rows] for k, v in data.items()}
    per = rows // num_micro
    return [{k: v[i * per : (i + 1) * per] for k, v in local.items()} for i in range(num_micro)]


def masked_sum_loss(losses: torch.Tensor, mask: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """The project's convention: masked sum over the microbatch / global-batch loss tokens."""
    return (losses.float() * mask).sum() / num_tokens


def build(ps: ParallelState, cfg: ModelConfig, weights: dict[str, torch.Tensor], ddp_cfg: DDPConfig, opt_cfg):
    model = GPTModel(cfg, ps)
    load_full_state_dict(model, weights)
    ddp = DistributedDataParallel(model, ps, ddp_cfg)
    return model, ddp, build_optimizer(opt_cfg, [ddp], ps)


def train_pp1(ps, model, ddp, opt, batches, *, num_micro: int) -> list[tuple[bool, float | None]]:
    """Steps over ``batches``; earlier microbatches run under ``no_sync``."""
    results = []
    for data in batches:
        micro = local_microbatches(data, ps, num_micro)
        n_tokens = global_loss_tokens([m["loss_mask"] for m in micro], ps)
        opt.zero_grad()
        for i, mb in enumerate(micro):
            with ddp.no_sync() if i < num_micro - 1 else nullcontext():
                losses = model(mb["tokens"], labels=mb["labels"])
                opt.scale_loss(masked_sum_loss(losses, mb["loss_mask"], n_tokens)).backward()
        finalize_model_grads([ddp])
        ok, norm, _ = opt.step()
        results.append((ok, norm))
    return results


def worker_pp1(rank: int, world: int, tp: int, cfg, weights, batches, ddp_cfg, opt_cfg, num_micro: int):
    ps = ParallelState.from_distributed(ParallelConfig(tp=tp), seed=0)
    model, ddp, opt = build(ps, cfg, weights, ddp_cfg, opt_cfg)
    steps = train_pp1(ps, model, ddp, opt, batches, num_micro=num_micro)
    return {"params": gather_full_state_dict(model), "steps": steps}


def reference(cfg, weights, batches, opt_cfg, ddp_cfg: DDPConfig | None = None):
    """One process, whole global batch as one microbatch, the plain (non-distributed) optimizer."""
    ps = ParallelState.single()
    opt_cfg = dataclasses.replace(opt_cfg, use_distributed_optimizer=False)
    model, ddp, opt = build(ps, cfg, weights, ddp_cfg or DDPConfig(), opt_cfg)
    steps = train_pp1(ps, model, ddp, opt, batches, num_micro=1)
    return gather_full_state_dict(model), steps, opt


def assert_params_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(ref)
    for name, v in ref.items():
        torch.testing.assert_close(got[name], v, **FP32_TOL, msg=lambda m, n=name: f"{n}: {m}")  # type: ignore[arg-type,misc]


def worker_pipeline(
    rank: int, world: int, tp: int, pp: int, cfg, weights, batches, ddp_cfg, opt_cfg, num_micro
):
    """tp x pp x dp training through the pipeline package (lead's API)."""
    from pretrain.pipeline.embedding_sync import allreduce_embedding_grads
    from pretrain.pipeline.partition import build_model_chunks
    from pretrain.pipeline.schedules import forward_backward
    from pretrain.tensor_parallel.sequence_parallel import allreduce_sequence_parallel_grads

    ps = ParallelState.from_distributed(ParallelConfig(tp=tp, pp=pp), seed=0)
    chunks = build_model_chunks(cfg, ps)
    for c in chunks:
        load_full_state_dict(c, weights, strict=True)
    ddps = [DistributedDataParallel(c, ps, ddp_cfg) for c in chunks]
    opt = build_optimizer(opt_cfg, ddps, ps)
    for d in ddps:  # the schedule interleaves microbatches, so count accumulations instead of no_sync
        d.grad_accumulation_steps = num_micro
    steps = []
    for data in batches:
        micro = local_microbatches(data, ps, num_micro)
        n_tokens = global_loss_tokens([m["loss_mask"] for m in micro], ps)
        opt.zero_grad()

        def loss_fn(losses: torch.Tensor, mb: dict[str, Any], n: float = n_tokens) -> torch.Tensor:
            return opt.scale_loss(masked_sum_loss(losses, mb["loss_mask"], n))

        def sums() -> None:  # before the DP reduction, as the training loop does
            allreduce_embedding_grads(chunks, ps)
            allreduce_sequence_parallel_grads(chunks, ps.tp_group)

        def finalize(ddps: list[DistributedDataParallel] = ddps) -> None:
            finalize_model_grads(ddps, embedding_sync=sums)

        forward_backward(chunks=chunks, ps=ps, microbatches=micro, loss_fn=loss_fn, finalize_grads=finalize)
        ok, norm, _ = opt.step()
        steps.append((ok, norm))
    full: dict[str, torch.Tensor] = {}
    for c in chunks:
        for k, v in gather_full_state_dict(c).items():
            if k in full:  # the tied head copy must stay equal to the first stage's embedding
                torch.testing.assert_close(v, full[k], rtol=0, atol=0)
            full[k] = v
    return {"params": full, "steps": steps, "dp_rank": ps.dp_rank, "tp_rank": ps.tp_rank}
