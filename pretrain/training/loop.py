"""The one training loop: every model family and finetuning task plugs in as a ``TrainTask``.

Per iteration: zero the gradient buffers; run this rank's pipeline schedule over its
microbatches; finalize gradients (tied-embedding all-reduce, then the data-parallel reduction);
one optimizer step (unscale, overflow check, clip, AdamW, copy back); advance the LR schedule on
successful steps; log; validate and save at their intervals.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pretrain.checkpoint.legacy.layout import iteration_dir
from pretrain.checkpoint.types import CheckpointMetadata
from pretrain.distributed.ddp import DDPConfig, DistributedDataParallel, finalize_model_grads
from pretrain.models.base import ShardedModule
from pretrain.models.cpu_gemm import resolve as resolve_cpu_gemm
from pretrain.models.init import init_model_parameters
from pretrain.models.sharding import is_vocab_tensor
from pretrain.optim import build_optimizer
from pretrain.optim.clip_grads import counts_for_norm
from pretrain.optim.config import LRScheduleConfig, OptimizerConfig
from pretrain.optim.lr_schedule import LRScheduler
from pretrain.optim.optimizer import MixedPrecisionOptimizer
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from pretrain.pipeline.embedding_sync import allreduce_embedding_grads
from pretrain.pipeline.schedules import forward_backward
from pretrain.tensor_parallel.sequence_parallel import allreduce_sequence_parallel_grads
from pretrain.training.checkpointing import (
    load_model_weights,
    restore_training_state,
    save_training_checkpoint,
)
from pretrain.training.config import TrainingConfig
from pretrain.training.exit import ExitConditions
from pretrain.training.logger import TrainingLogger
from pretrain.training.moe_stats import collect_router_stats
from pretrain.training.task import Microbatch, TrainTask
from pretrain.utils.errors import UserError


def setup_parallel(cfg: ParallelConfig, *, seed: int) -> ParallelState:
    """Initialise ``torch.distributed`` when launched by torchrun (NCCL on GPUs, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not dist.is_initialized():
        if cfg.tp * cfg.pp > 1:
            raise UserError(
                f"--tp {cfg.tp} x --pp {cfg.pp} needs {cfg.tp * cfg.pp} processes: launch with torchrun"
            )
        return ParallelState.single(seed=seed)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return ParallelState.from_distributed(cfg, device=device, seed=seed)


@dataclass(kw_only=True)
class Trainer:
    """Model chunks, their DDP wrappers, optimizer and schedule of one run."""

    task: TrainTask
    ps: ParallelState
    optim_cfg: OptimizerConfig
    lr_cfg: LRScheduleConfig
    cfg: TrainingConfig
    ckpt_args: CheckpointMetadata | None  # the record each checkpoint carries (None: a run that never saves)
    chunks: list[ShardedModule] = field(init=False)
    ddps: list[DistributedDataParallel] = field(init=False)
    optimizer: MixedPrecisionOptimizer = field(init=False)
    scheduler: LRScheduler = field(init=False)
    skipped: int = 0
    loaded: dict[str, Any] | None = None  # the rest of a --load checkpoint (optimizer, rng, ...)

    def __post_init__(self) -> None:
        self.chunks = self.task.build_chunks(self.ps)
        for chunk in self.chunks:
            init_model_parameters(chunk, seed=self.cfg.seed)
        load_initial = getattr(self.task, "load_initial_weights", None)
        if load_initial is not None:  # finetuning: pretrained weights, before the optimizer copies them
            load_initial(self.chunks, self.ps)
        if self.cfg.load:  # --load: weights before the optimizer copies them into fp32 main params
            self.loaded = load_model_weights(
                self.cfg.load, self.chunks, self.ps, model_type=self.task.model_type
            )
        ddp_cfg = DDPConfig(
            use_distributed_optimizer=self.optim_cfg.use_distributed_optimizer,
            overlap_grad_reduce=self.cfg.overlap_grad_reduce,
        )
        self.ddps = [DistributedDataParallel(c, self.ps, ddp_cfg) for c in self.chunks]
        self.optimizer = build_optimizer(self.optim_cfg, self.ddps, self.ps)
        self.scheduler = LRScheduler(self.lr_cfg, self.optimizer)

    # --- one iteration ---------------------------------------------------------------------------
    def _run_schedule(self, mbs: list[Microbatch], *, forward_only: bool) -> torch.Tensor:
        norms = self.task.normalizers(mbs, self.ps)
        parts: list[dict[str, torch.Tensor]] = []

        def loss_fn(output: Any, mb: Microbatch) -> torch.Tensor:
            loss, named = self.task.loss(output, mb, norms)
            parts.append(named)
            return loss if forward_only else self.optimizer.scale_loss(loss)

        def model_parallel_sums() -> None:
            allreduce_embedding_grads(self.chunks, self.ps)
            allreduce_sequence_parallel_grads(self.chunks, self.ps.tp_group)

        def finalize() -> None:
            # The tied-embedding and sequence-parallel sums run before the DP reduction (with
            # ZeRO-1 each rank keeps only its shard of a gradient after it).
            finalize_model_grads(self.ddps, embedding_sync=model_parallel_sums)

        forward_backward(
            chunks=self.chunks, ps=self.ps, microbatches=mbs, loss_fn=loss_fn, forward_only=forward_only,
            finalize_grads=finalize, forward_step=self.task.forward_step, schedule=self.cfg.schedule,
            loss_scale=self.optimizer.loss_scale,
        )  # fmt: skip
        return self._reduce_parts(parts)

    def _reduce_parts(self, parts: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Global values of the named losses: last-stage, TP-rank-0 contributions summed over all ranks."""
        out = torch.zeros(len(self.task.loss_names), dtype=torch.float64)
        if self.ps.is_last_stage and self.ps.tp_rank == 0:
            for named in parts:
                out += torch.tensor([float(named[n]) for n in self.task.loss_names], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            out = out.to(self.ps.device)
            dist.all_reduce(out)
            out = out.cpu()
        return out

    def train_step(self, iteration: int) -> dict[str, Any]:
        start = time.perf_counter()
        mbs = self.task.microbatches("train", iteration, self.ps)
        self.optimizer.zero_grad()
        for d in self.ddps:  # bucket readiness counts every microbatch (no no_sync inside schedules)
            d.grad_accumulation_steps = len(mbs)
        losses = self._run_schedule(mbs, forward_only=False)
        lr = self.optimizer.get_lr()
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(self.cfg.global_batch_size if self.lr_cfg.by_samples else 1)
        else:
            self.skipped += 1
        elapsed = time.perf_counter() - start
        tokens = self.cfg.global_batch_size * self.cfg.seq_length
        world = self.ps.layout.world_size
        record: dict[str, Any] = {
            "iteration": iteration + 1,
            **{name: float(v) for name, v in zip(self.task.loss_names, losses, strict=True)},
            "loss": float(losses.sum()),
            "lr": lr,
            "grad_norm": grad_norm,
            "loss_scale": self.optimizer.loss_scale,
            "skipped_iterations": self.skipped,
            "iteration_time_s": elapsed,
            "tokens_per_s": tokens / elapsed,
            "tflops_per_rank": self.task.flops_per_iteration(self.cfg.global_batch_size)
            / elapsed
            / world
            / 1e12,
        }
        router = collect_router_stats(self.chunks, self.task.model_cfg, self.ps)
        if router is not None:
            record.update(router.record())
        return record

    def evaluate(self, split: str, call_index: int) -> float:
        """Mean loss over ``eval_iters`` global batches of ``split`` (dropout off, no gradients)."""
        for c in self.chunks:
            c.eval()
        total = torch.zeros(len(self.task.loss_names), dtype=torch.float64)
        for k in range(self.cfg.eval_iters):
            mbs = self.task.microbatches(split, call_index * self.cfg.eval_iters + k, self.ps)
            total += self._run_schedule(mbs, forward_only=True)
        for c in self.chunks:
            c.train()
        return float(total.sum()) / max(self.cfg.eval_iters, 1)

    def save(self, iteration: int) -> None:
        """Save a resumable checkpoint; an interrupted save leaves no ``iter_XXXXXXX.tmp`` behind."""
        assert self.cfg.save is not None
        try:
            # a task training LoRA adapters names their base weights (the checkpoint holds the adapter)
            save_training_checkpoint(self.cfg.save, iteration, self.chunks, self.ps, self.optimizer, self.scheduler,
                                     self.ckpt_args, lora_base=getattr(self.task, "lora_base", None))  # fmt: skip
        except BaseException:
            if self.ps.rank == 0:
                shutil.rmtree(iteration_dir(self.cfg.save, iteration).with_suffix(".tmp"), ignore_errors=True)
            raise


def train(
    task: TrainTask, *, ps: ParallelState, optim_cfg: OptimizerConfig, lr_cfg: LRScheduleConfig,
    cfg: TrainingConfig, ckpt_args: CheckpointMetadata | None, on_iteration: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run training; returns ``{"history": [...], "valid": [...], "start_iteration", "final_iteration"}``.

    Stops early (saving a checkpoint with ``--save``) on ``--exit-interval``,
    ``--exit-duration-in-mins`` or, with ``--exit-signal-handler``, SIGTERM; ``final_iteration``
    is then the last completed iteration and ``exit_reason`` says why.
    """
    trainer = Trainer(task=task, ps=ps, optim_cfg=optim_cfg, lr_cfg=lr_cfg, cfg=cfg, ckpt_args=ckpt_args)
    start = 0
    if trainer.loaded is not None:
        start = restore_training_state(trainer.loaded, ps, trainer.optimizer, trainer.scheduler, cfg)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0 and cfg.save:
        remove_stale_temporaries(cfg.save)
    log = TrainingLogger(enabled=rank0, total=cfg.train_iters, start=start, log_interval=cfg.log_interval,
                         json_path=cfg.log_json, progress=cfg.progress)  # fmt: skip
    if cfg.train_iters > start:  # (nothing to announce for an evaluation-only run)
        log.write(start_summary(trainer, start))
    history, valid = [], []
    exits = ExitConditions(cfg, device=ps.device)
    final, reason = cfg.train_iters, None
    try:
        with exits.handling_signals():
            for it in range(start, cfg.train_iters):
                record = trainer.train_step(it)
                history.append(record)
                log.iteration(record)
                if on_iteration is not None:
                    on_iteration(record)
                done = it + 1
                if cfg.eval_interval and done % cfg.eval_interval == 0:
                    loss = trainer.evaluate("valid", done // cfg.eval_interval - 1)
                    valid.append({"iteration": done, "loss": loss})
                    log.validation(done, loss)
                if done != cfg.train_iters and exits.should_exit(done):
                    final, reason = done, exits.reason
                    break
                if (
                    cfg.save
                    and cfg.save_interval
                    and done % cfg.save_interval == 0
                    and done != cfg.train_iters
                ):
                    trainer.save(done)
            if cfg.save and final > start:
                trainer.save(final)
                log.write(f"saved checkpoint at iteration {final} to {cfg.save}")
            if reason is not None:
                log.write(f"exiting after iteration {final} ({reason})")
    finally:
        log.close()
    return {"history": history, "valid": valid, "start_iteration": start, "final_iteration": final,
            "exit_reason": reason, "trainer": trainer}  # fmt: skip


def remove_stale_temporaries(save: str) -> None:
    """Remove ``iter_XXXXXXX.tmp`` folders an earlier, killed run left in ``save`` (global rank 0)."""
    root = Path(save)
    if root.is_dir():
        for tmp in root.glob("iter_*.tmp"):
            shutil.rmtree(tmp, ignore_errors=True)


def count_parameters(trainer: Trainer, *, vocab_size: int | None = None) -> int:
    """The whole model's parameter count, each tensor once (TP-replicated and the PP-tied head
    copy counted once, data-parallel replicas once); with ``vocab_size``, vocabulary tensors count
    only the true vocabulary's rows (padding is a layout detail, as in ``mlm-convert inspect``).
    A collective: every rank must call it."""
    ps = trainer.ps

    def size(name: str, p: torch.Tensor) -> int:
        if vocab_size is None or not is_vocab_tensor(name):
            return p.numel()
        rows = p.shape[0]  # this TP rank's slice of the padded rows; padding sits at the end
        return max(0, min(rows, vocab_size - ps.tp_rank * rows)) * (p.numel() // rows)

    local = sum(
        size(n, p) for c in trainer.chunks for n, p in c.named_parameters() if counts_for_norm(n, p, ps)
    )
    total = torch.tensor([float(local)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        total = total.to(ps.device)
        dist.all_reduce(total)
        total = total.cpu()
    return int(total.item()) // max(ps.dp_size, 1)


def start_summary(trainer: Trainer, start: int) -> str:
    """Megatron-style start line: model size, layout, batch and tokens per iteration, data."""
    ps, cfg = trainer.ps, trainer.cfg
    params = count_parameters(trainer)
    tokens = cfg.global_batch_size * cfg.seq_length
    data = getattr(getattr(trainer.task, "data_cfg", None), "data_prefix", None)
    where = f" | data {' '.join(data)}" if data else ""
    resume = f" | resuming at iteration {start}" if start else ""
    return (
        f"starting {trainer.task.model_type}: {params:,} parameters | tp={ps.tp_size} pp={ps.pp_size} "
        f"vp={ps.vp_size} dp={ps.dp_size} | global batch {cfg.global_batch_size} x seq {cfg.seq_length} = "
        f"{tokens:,} tokens/iteration | {cfg.train_iters} iterations{resume}{where}{_frozen_gemms(trainer)}"
    )


def _frozen_gemms(trainer: Trainer) -> str:
    """`` | frozen GEMMs in <library>`` on the CPU when the model has frozen fp32 weights (a LoRA
    base: :mod:`pretrain.models.cpu_gemm`), else nothing."""
    frozen = any(
        not p.requires_grad and p.dtype == torch.float32
        for chunk in trainer.chunks
        for p in chunk.parameters()
    )
    if trainer.ps.device.type != "cpu" or not frozen:
        return ""
    return f" | frozen GEMMs in {resolve_cpu_gemm(trainer.task.model_cfg.cpu_gemm)} (--cpu-gemm)"
