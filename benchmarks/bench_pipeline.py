"""Pipeline bubble and stored activations of our schedules, measured against theory.

Simulated mode (default): each stage's forward sleeps ``t_f`` and its backward ``2 t_f`` (split
evenly over the V virtual chunks), so p processes on a 2-core machine do not compete for CPU and
the measured step time shows the schedule alone. Ideal (no bubble) step = m (t_f + t_b); the
measured bubble fraction (T - ideal) / ideal is compared with (p - 1)/m for 1F1B and
(p - 1)/(V m) for interleaved 1F1B. Peak stored activations per rank are compared for
all-forward-then-all-backward (m) and 1F1B (p - r). Real mode (``--real``) also runs a tiny GPT
with p = 2 for a measured step time. Every configuration runs under ``torchrun`` (gloo).

    python benchmarks/bench_pipeline.py [--p 4] [--m 8] [--tf 0.05] [--steps 3] [--real]

Last line: ``{"max_bubble_rel_error": ..., "max_inflight_1f1b": ..., "max_inflight_fthenb": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, t: float) -> torch.Tensor:
        ctx.t = t
        time.sleep(t)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        time.sleep(2 * ctx.t)
        return g, g.sum().reshape(1), None


class SleepStage(nn.Module):
    """A stand-in stage: forward costs ``t`` seconds, backward ``2 t``."""

    def __init__(self, t: float, hidden: int) -> None:
        super().__init__()
        self.cfg = SimpleNamespace(hidden_size=hidden)
        self.w = nn.Parameter(torch.ones(1))
        self.t = t


def sleep_forward_step(model: Any, mb: dict, hidden: torch.Tensor | None, is_last: bool) -> torch.Tensor:
    x = (
        hidden
        if hidden is not None
        else mb["tokens"].float().unsqueeze(-1).expand(-1, -1, model.cfg.hidden_size)
    )
    out = _Sleep.apply(x, model.w, model.t)
    return out.mean() if is_last else out


def worker(cfg: dict[str, Any]) -> None:
    import torch.distributed as dist

    from pretrain.parallel.config import ParallelConfig
    from pretrain.parallel.state import ParallelState
    from pretrain.pipeline.schedules import forward_backward

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    p, m, vp = cfg["p"], cfg["m"], cfg["vp"]
    ps = ParallelState.from_distributed(ParallelConfig(pp=p, vp=vp))
    mbs = [{"tokens": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long)}] * m
    if cfg["real"]:
        chunks, step = _real_chunks(ps), None
    else:
        chunks, step = [SleepStage(cfg["tf"] / vp, 8) for _ in range(vp)], sleep_forward_step
    kwargs: dict[str, Any] = {"forward_step": step} if step else {}
    times, inflight = [], 0
    for i in range(cfg["steps"] + 1):
        stats: dict[str, Any] = {}
        dist.barrier()
        t = time.perf_counter()
        forward_backward(chunks=chunks, ps=ps, microbatches=mbs, loss_fn=lambda out, mb: out.mean(),
                         schedule=cfg["schedule"], stats=stats, **kwargs)  # fmt: skip
        dist.barrier()
        if i:
            times.append(time.perf_counter() - t)
        inflight = max(inflight, stats["max_inflight"])
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, inflight)
    if dist.get_rank() == 0:
        Path(cfg["out"]).write_text(json.dumps({"step_s": sorted(times)[len(times) // 2], "inflight": peaks}))
    dist.destroy_process_group()


def _real_chunks(ps: Any) -> list[Any]:
    from pretrain.config import ModelConfig
    from pretrain.models.init import init_model_parameters
    from pretrain.pipeline.partition import build_model_chunks

    cfg = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=1000,
                      max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    chunks = build_model_chunks(cfg, ps)
    for c in chunks:
        init_model_parameters(c, seed=0)
    return chunks


def run_config(**cfg: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg["out"] = f"{tmp}/result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg["p"]),
               "--master-port", str(29500 + os.getpid() % 1000), __file__, "--worker", json.dumps(cfg)]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return json.loads(Path(cfg["out"]).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--vp", type=int, default=2)
    ap.add_argument("--tf", type=float, default=0.15, help="simulated forward seconds per stage")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--real", action="store_true", help="also time a real tiny GPT with p=2")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    p, m, tf = args.p, args.m, args.tf
    ideal = m * 3 * tf
    rows, errors = [], []
    for name, vp, sched, theory in (
        ("1F1B", 1, "1f1b", (p - 1) / m),
        (f"interleaved V={args.vp}", args.vp, "1f1b", (p - 1) / (args.vp * m)),
        ("F-then-B", 1, "fthenb", (p - 1) / m),
    ):
        res = run_config(p=p, m=m, vp=vp, schedule=sched, tf=tf, steps=args.steps, real=False)
        bubble = (res["step_s"] - ideal) / ideal
        errors.append(abs(bubble - theory) / theory)
        rows.append((name, res["step_s"], ideal * (1 + theory), bubble, theory, res["inflight"]))
    print(f"p={p} m={m} t_f={tf}s t_b={2 * tf}s  ideal (no bubble) step {ideal:.3f}s")
    print(
        f"{'schedule':<16}{'step s':>9}{'theory s':>10}{'bubble':>9}{'theory':>9}  peak stored activations per rank"
    )
    for name, step, th_step, bubble, theory, inflight in rows:
        print(f"{name:<16}{step:>9.3f}{th_step:>10.3f}{bubble:>9.3f}{theory:>9.3f}  {inflight}")
    result: dict[str, Any] = {
        "max_bubble_rel_error": max(errors),
        "max_inflight_1f1b": max(rows[0][5]),
        "max_inflight_fthenb": max(rows[2][5]),
        "inflight_1f1b_per_rank": rows[0][5],
        "bubble": {r[0]: {"measured": r[3], "theory": r[4], "step_s": r[1]} for r in rows},
    }
    if args.real:
        real = run_config(p=2, m=m, vp=1, schedule="1f1b", tf=0.0, steps=args.steps, real=True)
        print(f"real tiny GPT, p=2, m={m}: step {real['step_s']:.3f}s")
        result["real_p2_step_s"] = real["step_s"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
