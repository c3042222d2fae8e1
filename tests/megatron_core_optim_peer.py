"""A real peer for optimizer state: megatron-core trains, saves and resumes with its own optimizer.

Run as ``python -m tests.megatron_core_optim_peer train|resume ...`` (the tests do, in a
subprocess, with ``--tp`` processes). Nothing here is mlm-toolkit code. The model is
megatron-core's ``GPTModel`` (see :mod:`tests.megatron_core_peer`), the parameter groups come from
megatron-core's ``_get_param_groups`` (no weight decay on biases and 1-D tensors), the optimizer
from ``_get_megatron_optimizer_based_on_param_groups`` (``FP32Optimizer`` over torch ``AdamW``;
``Float16OptimizerWithFloat16Params`` with ``--bf16``) and the schedule from megatron-core's
``OptimizerParamScheduler`` stepped by the global batch size, as Megatron-LM's ``train_step`` does.
Checkpoints are what Megatron-LM's ``save_checkpoint`` puts in a ``torch_dist`` directory:
``{"model", "optimizer", "opt_param_scheduler", "iteration", "args", "checkpoint_version"}``
through ``dist_checkpointing.save``.

* ``train OUT --steps N --save-at K``: N steps on :func:`batch` ``0..N-1``; saves after step K
  under ``OUT/ckpt`` (``torch_dist``) and ``OUT/legacy`` (legacy ``torch``, the optimizer's own
  position-keyed ``state_dict()``) and writes ``OUT/losses.pt`` and the final full parameters ``OUT/params.pt``.
* ``resume CKPT OUT --steps N``: loads model, optimizer and scheduler from ``CKPT`` (an iteration
  directory) and continues to step N (batches ``iteration..N-1``); writes ``OUT/losses.pt``,
  ``OUT/params.pt`` and ``OUT/loaded_state.pt`` (the optimizer state right after loading, full
  tensors by megatron-core key).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.megatron_core_peer import (
    CASES,
    build_model,
    finish_peer,
    init_peer,
    megatron_args,
    save_dist,
    spawn_ranks,
)
from tests.ports import free_port

LR, WD, BATCH, SEQ = 1e-2, 0.1, 4, 16
GATED = [False]  # set from the case: SwiGLU linear_fc1 shards are [gate; up]
# what Megatron-LM's --dist-ckpt-optim-fully-reshardable asks of the distributed optimizer
# (the non-distributed optimizers ignore it)
FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable"}


def batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels ``[BATCH, SEQ]`` of ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _cpu_factories() -> None:
    """The distributed optimizer allocates with ``device="cuda"`` and calls ``.cuda()`` while it
    steps and saves: CPU here (this process is only a peer)."""
    for name in ("zeros", "empty", "ones", "full", "arange", "tensor"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]


def _on_cpu(factory: Any) -> Any:
    def f(*a: Any, **k: Any) -> Any:
        if str(k.get("device", "")).startswith("cuda"):
            k["device"] = "cpu"
        return factory(*a, **k)

    return f


def _distributed_optimizer(model: Any, config: Any) -> tuple[Any, Any]:
    """megatron-core's DDP wrapper and ``get_megatron_optimizer`` (a ``DistributedOptimizer``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer

    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
        model,
    )
    return get_megatron_optimizer(config, [ddp]), ddp


def _optimizer(model: Any, bf16: bool, distopt: bool = False) -> tuple[Any, Any, Any]:
    """``(optimizer, scheduler, ddp)`` (``ddp`` None without the distributed optimizer)."""
    from megatron.core.optimizer import (
        OptimizerConfig,
        _get_megatron_optimizer_based_on_param_groups,
        _get_param_groups,
    )
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        optimizer="adam", lr=LR, min_lr=LR, weight_decay=WD, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, clip_grad=0.0, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=distopt,
    )  # fmt: skip
    groups = _get_param_groups([model], config, None)
    ddp = None
    real_tensor, real_type = torch.tensor, torch.Tensor.type
    # CPU shims while the optimizer is built: it allocates small buffers with device="cuda", and
    # Float16OptimizerWithFloat16Params accepts only parameters whose type() is a CUDA type.
    torch.tensor = lambda *a, **k: real_tensor(*a, **{**k, "device": "cpu"})  # type: ignore[assignment]
    torch.Tensor.type = lambda self, *a, **k: (  # type: ignore[method-assign]
        real_type(self, *a, **k) if a or k else real_type(self).replace("torch.", "torch.cuda.", 1)
    )
    try:
        if distopt:
            optimizer, ddp = _distributed_optimizer(model, config)
        else:
            optimizer = _get_megatron_optimizer_based_on_param_groups(config, [model], groups)
    finally:
        torch.tensor, torch.Tensor.type = real_tensor, real_type  # type: ignore[assignment,method-assign]
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=100 * BATCH,
        lr_decay_style="constant", start_wd=WD, end_wd=WD, wd_incr_steps=100 * BATCH, wd_incr_style="constant",
    )  # fmt: skip
    return optimizer, scheduler, ddp


def _train_step(model: Any, optimizer: Any, scheduler: Any, step: int, vocab: int, ddp: Any = None) -> float:
    tokens, labels = batch(step, vocab)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    optimizer.zero_grad()
    if ddp is not None:
        ddp.zero_grad_buffer()
    loss = (ddp or model)(tokens, pos, mask, labels=labels).float().mean()
    loss.backward()
    if ddp is not None:
        ddp.finish_grad_sync()
    optimizer.step()
    scheduler.step(increment=BATCH)
    return float(loss)


def _full_params(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter as the full (TP-gathered) fp32 tensor, keyed by its ``state_dict`` name."""
    return {name: _gather(name, p, p.detach().float()) for name, p in model.named_parameters()}


def _gather(name: str, param: Any, local: torch.Tensor) -> torch.Tensor:
    """The full tensor of TP-split ``param`` (``local``: a tensor shaped like it).

    Split parameters carry megatron-core's ``tensor_model_parallel`` / ``partition_dim``; a
    SwiGLU ``linear_fc1`` shard is ``[gate_r; up_r]``, so its halves are gathered separately."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    if not getattr(param, "tensor_model_parallel", False) or dist.get_world_size(group) == 1:
        return local.clone()
    dim = param.partition_dim
    halves = local.chunk(2, dim=0) if "linear_fc1" in name and GATED[0] else (local,)
    full = []
    for half in halves:
        parts = [torch.empty_like(half) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, half.contiguous(), group=group)
        full.append(torch.cat(parts, dim=dim))
    return torch.cat(full, dim=0)


def _state(
    model: Any, optimizer: Any, scheduler: Any, args: Any, iteration: int, *, is_loading: bool = False
) -> dict[str, Any]:
    model_sd = model.sharded_state_dict()
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=FULLY_RESHARDABLE
        ),
        "opt_param_scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "args": args,
        "checkpoint_version": 3.0,
    }


def _save_legacy(root: Path, model: Any, optimizer: Any, scheduler: Any, args: Any, iteration: int) -> None:
    """Megatron-LM's legacy ``--ckpt-format torch`` save: one ``model_optim_rng.pt`` per TP rank
    with the model state dict and the optimizer's own (position-keyed) ``state_dict()``."""
    rank = dist.get_rank()
    d = root / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}"
    d.mkdir(parents=True, exist_ok=True)
    state = {
        "args": args, "checkpoint_version": 3.0, "iteration": iteration,
        "model": {k: v for k, v in model.state_dict().items() if "_extra_state" not in k},
        "optimizer": optimizer.state_dict(), "opt_param_scheduler": scheduler.state_dict(),
    }  # fmt: skip
    torch.save(state, d / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def _dump_distributed_state(path: Path, model: Any, optimizer: Any) -> None:
    """The distributed optimizer's per-parameter state (``param``, ``exp_avg``, ``exp_avg_sq``) as
    full tensors by parameter name, from its own accessor (data-parallel size 1: one rank holds
    each parameter's whole TP shard)."""
    (dist_opt,) = optimizer.chained_optimizers
    out = {}
    for name, p in model.named_parameters():
        for kind, t in dist_opt._get_main_param_and_optimizer_states(p).items():
            if kind != "step":
                out[f"{kind}.{name}"] = _gather(name, p, t.detach().float().view_as(p))
    if dist.get_rank() == 0:
        torch.save(out, path)


def _loaded_optimizer_state(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """``{"<state>.<param name>": full tensor}`` of the optimizer's per-parameter state
    (``exp_avg``, ``exp_avg_sq``, ``step``; ``fp32_param`` for the mixed-precision optimizer)."""
    names = {id(p): n for n, p in model.named_parameters()}
    inner = optimizer.optimizer
    mixed = hasattr(optimizer, "fp32_from_float16_groups")
    out: dict[str, torch.Tensor] = {}
    for gi, group in enumerate(inner.param_groups):
        for pi, p in enumerate(group["params"]):
            model_param = optimizer.float16_groups[gi][pi] if mixed else p
            name = names[id(model_param)]
            for kind, value in inner.state[p].items():
                if kind == "step":
                    out[f"step.{name}"] = torch.as_tensor(value).float()
                else:
                    out[f"{kind}.{name}"] = _gather(name, model_param, value.float())
            if mixed:
                out[f"fp32_param.{name}"] = _gather(name, model_param, p.detach().float())
            out[f"wd.{name}"] = torch.tensor(group["weight_decay"])
    return out


def _train(out: Path, case: str, tp: int, steps: int, save_at: int, bf16: bool, distopt: bool) -> None:

    args = megatron_args(case, tp)
    args.bf16, args.lr, args.weight_decay = bf16, LR, WD
    args.params_dtype = torch.bfloat16 if bf16 else torch.float32  # as Megatron-LM's validate_args sets it
    args.global_batch_size = args.micro_batch_size = BATCH
    GATED[0] = bool(args.swiglu)
    torch.manual_seed(1234)
    model = build_model(args).train()
    if bf16:
        model = model.to(torch.bfloat16)
    optimizer, scheduler, ddp = _optimizer(model, bf16, distopt)
    losses = []
    for step in range(steps):
        losses.append(_train_step(model, optimizer, scheduler, step, args.vocab_size, ddp))
        if step + 1 == save_at:
            save_dist(out / "ckpt", _state(model, optimizer, scheduler, args, save_at), save_at)
            if ddp is None:  # the legacy format keeps a distributed optimizer's state in distrib_optim.pt
                _save_legacy(out / "legacy", model, optimizer, scheduler, args, save_at)
            else:
                _dump_distributed_state(out / "saved_state.pt", model, optimizer)
    _finish(out, model, losses)


def _resume(ckpt: Path, out: Path, tp: int, steps: int) -> None:
    from megatron.core import dist_checkpointing

    common = torch.load(ckpt / "common.pt", weights_only=False)
    args = copy.copy(common["args"])
    args.tensor_model_parallel_size = tp
    bf16 = bool(getattr(args, "bf16", False))
    GATED[0] = bool(args.swiglu)
    model = build_model(args).train()
    if bf16:
        model = model.to(torch.bfloat16)
    # (a distributed optimizer is not resumed here: megatron-core 0.16 restores its
    # fully_reshardable state only with apex/TE optimizers, whose state has no per-param "step")
    optimizer, scheduler, ddp = _optimizer(model, bf16)
    template = _state(model, optimizer, scheduler, args, 0, is_loading=True)
    loaded = dist_checkpointing.load(template, str(ckpt))
    model.load_state_dict(loaded["model"], strict=False)
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    loaded_state = _loaded_optimizer_state(model, optimizer)
    loaded_steps = scheduler.num_steps
    losses = [
        _train_step(model, optimizer, scheduler, step, args.vocab_size, ddp)
        for step in range(int(loaded["iteration"]), steps)
    ]
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"state": loaded_state, "num_steps": loaded_steps}, out / "loaded_state.pt")
    _finish(out, model, losses)


def _load_distributed(ckpt: Path, out: Path, tp: int) -> None:
    """What megatron-core's ``dist_checkpointing.load`` gives a ``DistributedOptimizer`` asking for
    the ``fully_reshardable`` format: every rank's loaded ``param_state`` tensors, the group
    hyperparameters and the scheduler state (``OUT/rank{r}.pt``). (Not ``load_state_dict``:
    megatron-core 0.16 restores that format only with apex/TE optimizers.)"""
    from megatron.core import dist_checkpointing

    common = torch.load(ckpt / "common.pt", weights_only=False)
    args = copy.copy(common["args"])
    args.tensor_model_parallel_size = tp
    GATED[0] = bool(args.swiglu)
    model = build_model(args).train()
    optimizer, scheduler, _ = _optimizer(model, False, distopt=True)
    for inner in optimizer.chained_optimizers:  # torch's Adam creates its state lazily
        inner._init_optimizer_states_with_dummy_values()
    loaded = dist_checkpointing.load(_state(model, optimizer, scheduler, args, 0, is_loading=True), str(ckpt))
    opt = loaded["optimizer"]
    groups = [
        {k: g[k] for k in ("lr", "weight_decay", "wd_mult", "step")} for g in opt["optimizer"]["param_groups"]
    ]
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"param_state": opt["param_state"], "param_groups": groups, "sharding": opt["param_state_sharding_type"],
                "scheduler": loaded["opt_param_scheduler"]}, out / f"rank{dist.get_rank()}.pt")  # fmt: skip


def _finish(out: Path, model: Any, losses: list[float]) -> None:
    params = _full_params(model)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(torch.tensor(losses), out / "losses.pt")
        torch.save(params, out / "params.pt")


def _worker(rank: int, a: argparse.Namespace) -> None:
    init_peer(rank, a.tp, a.port)
    if a.cmd == "train":
        if a.distopt:
            _cpu_factories()
        _train(Path(a.paths[0]), a.case, a.tp, a.steps, a.save_at, a.bf16, a.distopt)
    elif a.cmd == "load_distributed":
        _cpu_factories()
        _load_distributed(Path(a.paths[0]), Path(a.paths[1]), a.tp)
    else:
        _resume(Path(a.paths[0]), Path(a.paths[1]), a.tp, a.steps)
    finish_peer()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=("train", "resume", "load_distributed"))
    p.add_argument("paths", nargs="+", help="train: OUT; resume, load_distributed: CKPT_ITER_DIR OUT")
    p.add_argument("--case", default="llama", choices=sorted(CASES))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-at", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument(
        "--distopt", action="store_true", help="the distributed optimizer (saved fully_reshardable)"
    )
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    a = p.parse_args(argv)
    a.port = a.port or free_port()
    spawn_ranks(_worker, (a,), a.tp)


if __name__ == "__main__":
    sys.exit(main())
