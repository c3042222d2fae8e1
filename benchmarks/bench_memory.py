"""Measured bytes per parameter of model params, grads, main params/grads and Adam state.

Runs d = 1, 2, 4 data-parallel gloo processes (CPU, fork) for fp16, bf16 and fp32 training,
with and without the distributed optimizer, takes one real optimizer step, and sums the bytes of
the tensors that actually exist on each rank (unique storages, padding included), divided by the
rank's number of model parameters. Printed beside REFERENCE.md's table:

=================================  ================  =================================
case                               non-distributed   distributed (ZeRO-1)
=================================  ================  =================================
fp16 params, fp16 grads            20                4 + 16/d
bf16 params, fp32 grads            18                6 + 12/d
fp32 params, fp32 grads            16                8 + 8/d
=================================  ================  =================================

Accounting that yields the table (what this code allocates):

* fp16/fp16: 2 (fp16 param) + 2 (fp16 grad buffer) + 4 (fp32 main param) + 4 (fp32 copy of the
  grad, the main grad Adam reads) + 8 (Adam m, v) = 20; ZeRO-1 shards the last 16.
* bf16/fp32: 2 (param) + 4 (fp32 grad buffer, read by Adam in place: no copy) + 4 (main param)
  + 8 (Adam) = 18; ZeRO-1 shards main param and Adam state (12).
* fp32/fp32: 4 (param, which *is* the main param) + 4 (grad buffer) + 8 (Adam) = 16; ZeRO-1
  shards Adam state (8).

The grad buffer stays full size on every rank (the reduce-scatter input), so grads are not
divided by d. Deviations come only from bucket padding and Adam's per-tensor ``step`` scalars.
The last line is one JSON object (``max_abs_error_bytes_per_param`` = largest deviation).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pretrain.config import DTypeName, ModelConfig
from pretrain.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads, global_loss_tokens
from pretrain.models.gpt import GPTModel
from pretrain.models.init import init_model_parameters
from pretrain.optim import OptimizerConfig, build_optimizer
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState

CASES: dict[
    str, tuple[DTypeName, bool, float, Any]
] = {  # name: (params_dtype, fp16 grads?, table non-distributed, table distributed f(d))
    "fp16": ("float16", True, 20.0, lambda d: 4 + 16 / d),
    "bf16": ("bfloat16", False, 18.0, lambda d: 6 + 12 / d),
    "fp32": ("float32", False, 16.0, lambda d: 8 + 8 / d),
}


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measure(rank: int, case: str, distributed: bool, hidden: int) -> dict[str, Any]:
    dtype_name, fp16_grads, _, _ = CASES[case]
    ps = ParallelState.from_distributed(ParallelConfig(tp=1), seed=0)
    cfg = ModelConfig(
        num_layers=2, hidden_size=hidden, num_attention_heads=8, vocab_size=1003,
        max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype_name,
    )  # fmt: skip
    model = GPTModel(cfg, ps)
    init_model_parameters(model, seed=1)
    ddp = DistributedDataParallel(
        model, ps, DDPConfig(grad_reduce_in_fp32=not fp16_grads, use_distributed_optimizer=distributed)
    )
    opt_cfg = OptimizerConfig(
        fp16=case == "fp16", bf16=case == "bf16", use_distributed_optimizer=distributed,
        loss_scale=1.0 if case == "fp16" else None,
    )  # fmt: skip
    opt = build_optimizer(opt_cfg, [ddp], ps)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=gen)
    mask = torch.ones(2, 16)
    opt.zero_grad()
    n = global_loss_tokens([mask], ps)
    losses = model(tokens[:, :-1], labels=tokens[:, 1:])
    opt.scale_loss((losses.float() * mask).sum() / n).backward()
    finalize_model_grads([ddp])
    ok, _, _ = opt.step()
    assert ok, "the measured step must succeed (state is allocated either way)"
    params = [p for p in model.parameters()]
    mem = opt.memory_bytes()
    return {
        "numel": sum(p.numel() for p in params),
        "model_params": _storage_bytes(params),
        "grads": _storage_bytes([p.main_grad for p in params]),  # type: ignore[attr-defined]
        **mem,
    }


def _worker(rank: int, world: int, tmp: str, args: tuple[Any, ...]) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
        torch.save(measure(rank, *args), f"{tmp}/r{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        code = 1
    os._exit(code)


def run(world: int, *args: Any) -> list[dict[str, Any]]:
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, tmp, args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"benchmark ranks failed: {[p.exitcode for p in procs]}")
        return [torch.load(f"{tmp}/r{r}.pt", weights_only=True) for r in range(world)]


FIELDS = ("model_params", "grads", "main_params", "main_grads", "optimizer_state")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of the 2-layer GPT measured")
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args(argv)
    header = f"{'case':5} {'d':>2} {'optimizer':11} " + " ".join(f"{f:>15}" for f in FIELDS)
    print(header + f" {'total':>8} {'table':>8} {'error':>8}")
    rows, max_err = [], 0.0
    for case, (_, _, table_plain, table_dist) in CASES.items():
        for d in args.dp:
            for distributed in (False, True):
                results = run(d, case, distributed, args.hidden)
                expected = table_dist(d) if distributed else table_plain
                per_rank = [{f: r[f] / r["numel"] for f in FIELDS} for r in results]
                totals = [sum(pr.values()) for pr in per_rank]
                err = max(abs(t - expected) for t in totals)
                max_err = max(max_err, err)
                worst = per_rank[max(range(d), key=lambda i: abs(totals[i] - expected))]
                name = "distributed" if distributed else "plain"
                cols = " ".join(f"{worst[f]:15.4f}" for f in FIELDS)
                print(
                    f"{case:5} {d:>2} {name:11} {cols} {sum(worst.values()):8.4f} {expected:8.4f} {err:8.4f}"
                )
                rows.append({"case": case, "d": d, "distributed": distributed, "bytes_per_param": totals,
                             "table": expected})  # fmt: skip
    print(json.dumps({"max_abs_error_bytes_per_param": max_err, "hidden": args.hidden, "rows": rows}))


if __name__ == "__main__":
    main()
