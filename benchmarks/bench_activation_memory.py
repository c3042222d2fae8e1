"""Activation memory per rank: plain TP vs TP + sequence parallelism vs TP + SP + selective recompute.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), table 2:
per layer ``s b h (10 + 24/t + 5 a s/(h t))`` bytes with TP, ``s b h (34/t + 5 a s/(h t))`` with
TP + SP, ``s b h 34/t`` with TP + SP + selective recomputation (16-bit activations, 1-byte masks).

For each TP size (1, 2, 4; one gloo process per rank, spawned) this builds the transformer block
(``--layers`` layers and the final norm) in bf16 with dropout on, runs one forward on a
``[b, s, h]`` batch and *counts* the bytes autograd keeps for backward on that rank
(:class:`benchmarks.saved_bytes.SavedBytes`: saved tensors deduplicated by storage, parameters
excluded, checkpoint inputs included). The backward is run too, and its FLOPs counted with
``torch.utils.flop_counter.FlopCounterMode``: the extra FLOPs of the selective backward over the
plain one are the recomputed ops, reported over the plain step's forward + backward FLOPs.

The last line is JSON: ``sp_selective_over_tp`` (TP + SP + selective over plain TP at the largest
TP; goal <= 1/3), ``recompute_flops_overhead`` (goal <= 0.05), and every measurement.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

MODES = {"tp": {}, "tp_sp": {"sequence_parallel": True},
         "tp_sp_selective": {"sequence_parallel": True, "recompute_granularity": "selective"}}  # fmt: skip


def _config(shape: dict[str, int], mode: str) -> Any:
    from pretrain.config import ModelConfig

    return ModelConfig(
        num_layers=shape["layers"], hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
        vocab_size=1024, max_position_embeddings=shape["seq"], hidden_dropout=0.1, attention_dropout=0.1,
        params_dtype="bfloat16", **MODES[mode],  # type: ignore[arg-type]
    )  # fmt: skip


def _measure(ps: Any, shape: dict[str, int], mode: str) -> dict[str, float]:
    """Saved bytes of one block forward on this rank, and forward / backward FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.saved_bytes import SavedBytes
    from pretrain.models.transformer import TransformerBlock

    cfg = _config(shape, mode)
    block = TransformerBlock(cfg, ps, layer_numbers=range(cfg.num_layers), final_layernorm=True)
    gen = torch.Generator().manual_seed(0)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.02 + (1.0 if p.ndim == 1 else 0.0))
    x = torch.randn(shape["batch"], shape["seq"], cfg.hidden_size, generator=gen).to(torch.bfloat16)
    if cfg.sequence_parallel and ps.tp_size > 1:
        x = x.chunk(ps.tp_size, dim=1)[ps.tp_rank]
    x = x.clone().requires_grad_(True)
    block.train()
    ps.seed(1)
    counter = SavedBytes(exclude=block.parameters())
    with FlopCounterMode(display=False) as fwd, counter.counting():
        out = block(x)
    with FlopCounterMode(display=False) as bwd:
        out.float().square().mean().backward()
    return {
        "saved_bytes": counter.total,
        "fwd_flops": fwd.get_total_flops(),
        "bwd_flops": bwd.get_total_flops(),
    }


def _worker(rank: int, tp: int, tmp: str, shape: dict[str, int]) -> None:
    import torch.distributed as dist

    from pretrain.parallel.config import ParallelConfig
    from pretrain.parallel.state import ParallelState

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=tp)
    ps = ParallelState.from_distributed(ParallelConfig(tp=tp))
    result = {mode: _measure(ps, shape, mode) for mode in MODES}
    Path(f"{tmp}/rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run_tp(tp: int, shape: dict[str, int]) -> dict[str, dict[str, float]]:
    """Spawn ``tp`` gloo ranks; per mode the largest per-rank measurement."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, tp, tmp, shape)) for r in range(tp)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a tp={tp} rank failed (exit codes {[p.exitcode for p in procs]})")
        ranks = [json.loads(Path(f"{tmp}/rank{r}.json").read_text()) for r in range(tp)]
    return {mode: {k: max(r[mode][k] for r in ranks) for k in ranks[0][mode]} for mode in MODES}


def paper_bytes(shape: dict[str, int], tp: int) -> dict[str, float]:
    """Table 2 of the paper, per rank for the whole block (``layers`` x the per-layer formula)."""
    s, b, h, a, n = shape["seq"], shape["batch"], shape["hidden"], shape["heads"], shape["layers"]
    sbh, attn = s * b * h, 5 * a * s / (h * tp)
    return {"tp": n * sbh * (10 + 24 / tp + attn), "tp_sp": n * sbh * (34 / tp + attn),
            "tp_sp_selective": n * sbh * 34 / tp}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--smoke", action="store_true", help="tiny shape, tp 1 and 2 (a test runs this)")
    args = ap.parse_args(argv)
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "batch")}
    tps = args.tp
    if args.smoke:
        shape, tps = {"layers": 1, "hidden": 64, "heads": 8, "seq": 32, "batch": 1}, [1, 2]
    rows: dict[str, Any] = {}
    for tp in tps:
        measured, paper = run_tp(tp, shape), paper_bytes(shape, tp)
        rows[str(tp)] = {m: {**measured[m], "paper_bytes": paper[m]} for m in MODES}
        line = "  ".join(
            f"{m} {measured[m]['saved_bytes'] / 2**20:8.2f} MiB (paper {paper[m] / 2**20:7.2f})"
            for m in MODES
        )
        print(f"tp={tp}: {line}")
    top = rows[str(max(tps))]
    plain, selective = top["tp"], top["tp_sp_selective"]
    result = {
        "host": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "shape": shape,
        "tp": max(tps),
        "sp_over_tp": top["tp_sp"]["saved_bytes"] / plain["saved_bytes"],
        "sp_selective_over_tp": selective["saved_bytes"] / plain["saved_bytes"],
        "paper_sp_selective_over_tp": selective["paper_bytes"] / plain["paper_bytes"],
        "recompute_flops_overhead": (selective["bwd_flops"] - top["tp_sp"]["bwd_flops"])
        / (top["tp_sp"]["fwd_flops"] + top["tp_sp"]["bwd_flops"]),
        "per_tp": rows,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
