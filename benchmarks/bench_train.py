"""Training tokens/s of our single-process loop against a plain PyTorch loop around HF GPT-2.

*Ours* is the real training loop: ``mlm-pretrain gpt`` flags parsed by
:mod:`pretrain.training.cli` into configs, a :class:`~pretrain.training.gpt_task.GPTTask` and
:func:`pretrain.training.loop.train` (gradient buffers, MixedPrecisionOptimizer in fp32, global
norm clipping, LR scheduler, logger). *Plain* is the loop a PyTorch user writes around Hugging
Face ``GPT2LMHeadModel`` of the same shape: forward, masked token-mean cross-entropy, backward,
``clip_grad_norm_(1.0)``, ``torch.optim.AdamW`` (same lr, weight decay -- not on biases and
LayerNorms, as ours --, betas, eps), ``zero_grad``.

Data: a preprocessed indexed dataset built in a temp dir from the built-in corpus with a tiny
byte-level BPE (default 1024 tokens, a multiple of 128 so our padded vocab equals the
tokenizer's and both models have the same embedding). The plain loop reads its batches from
*our* dataset object (``task.microbatches("train", i, ...)``), so both loops see identical
token samples, and both pay for fetching them. Both start from the same weights (our seeded
init converted with :func:`pretrain.models.families.gpt2.canonical_to_hf`), dropout off, fp32, SDPA
attention; the first-iteration losses are printed as a sanity check.

Iterations alternate (ours i, plain i, ours i+1, ...: the plain step runs inside our loop's
``on_iteration`` callback and is excluded from our timing), so machine noise hits both alike.
Warmup iterations are excluded, then the median iteration time of each side is compared (wall
time gives ``ratio``; process CPU time, all threads, gives ``cpu_ratio``, a cross-check that is
less sensitive to other load on a shared machine). The
fraction of the measured matmul peak (median of large fp32 GEMMs, as in bench_gpt_step.py) uses
model FLOPs per token = 6 N + 12 L h s (N = all parameters).

Default shape (about a minute per side on 2 CPU cores): 6 layers, hidden 384, 6 heads, seq 256,
batch 8 (one microbatch), vocab 1024.

    python benchmarks/bench_train.py
    python benchmarks/bench_train.py --layers 2 --hidden 128 --heads 4 --seq 64 --iters 3   # quick
    python benchmarks/bench_train.py --micro-batch 4 --batch 8      # 2 microbatches (grad accumulation)

Last line: ``{"ratio": ours/plain tokens per second, "peak_fraction": ..., ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pretrain.training.run_configs import PretrainConfigs
from pretrain.training.task import TrainTask

os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:  # run as ``python benchmarks/<script>.py`` (benchmarks/ on sys.path) or as a module
    from common import matmul_peak_flops, model_flops_per_token
except ImportError:
    from benchmarks.common import matmul_peak_flops, model_flops_per_token


def make_data(root: Path, vocab_size: int) -> dict[str, str]:
    """Tiny BPE + preprocessed built-in corpus (as tests/train_fixtures.py)."""
    from pretrain.data.builtin import builtin_corpus_path
    from pretrain.tokenizer.train_tiny import train_tiny_gpt2_bpe
    from tools.preprocess import main as preprocess_main

    tok = train_tiny_gpt2_bpe(root / "tok", vocab_size=vocab_size)
    prefix = root / "corpus"
    rc = preprocess_main([
        "--input", str(builtin_corpus_path()), "--output-prefix", str(prefix),
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "vocab.json"),
        "--merge-file", str(tok / "merges.txt"), "--append-eod",
    ])  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"mlm-preprocess failed with exit code {rc}")
    return {
        "data": f"{prefix}_text_document",
        "vocab": str(tok / "vocab.json"),
        "merges": str(tok / "merges.txt"),
    }


def pretrain_argv(args: argparse.Namespace, data: dict[str, str]) -> list[str]:
    """``mlm-pretrain gpt`` flags of the benchmarked run."""
    flags: dict[str, object] = {
        "num-layers": args.layers, "hidden-size": args.hidden, "num-attention-heads": args.heads,
        "seq-length": args.seq, "micro-batch-size": args.micro_batch, "global-batch-size": args.batch,
        "train-iters": args.warmup + args.iters, "lr": args.lr, "lr-decay-style": "constant",
        "weight-decay": args.weight_decay, "adam-beta1": 0.9, "adam-beta2": 0.95, "adam-eps": 1e-8,
        "clip-grad": 1.0, "hidden-dropout": 0.0, "attention-dropout": 0.0,
        "log-interval": 10**9, "data-path": data["data"], "tokenizer-type": "GPT2BPETokenizer",
        "vocab-file": data["vocab"], "merge-file": data["merges"], "split": "100,0,0", "seed": 1234,
    }  # fmt: skip
    out = ["gpt"]
    for key, value in flags.items():
        out += [f"--{key}", str(value)]
    return [*out, "--no-progress"]


def build_plain(cfgs: PretrainConfigs, task: TrainTask) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """HF ``GPT2LMHeadModel`` with our initial weights, and a plain AdamW with Megatron's groups."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from pretrain.models.families.gpt2 import canonical_to_hf, hf_config_kwargs
    from pretrain.models.init import init_model_parameters
    from pretrain.models.sharding import gather_full_state_dict
    from pretrain.optim.param_groups import uses_weight_decay
    from pretrain.parallel.state import ParallelState

    model_cfg, train_cfg, optim = cfgs.model, cfgs.train, cfgs.optim
    (chunk,) = task.build_chunks(ParallelState.single(seed=train_cfg.seed))
    init_model_parameters(chunk, seed=train_cfg.seed)  # the same seeded init the Trainer applies
    padded = int(chunk.padded_vocab)
    hf_cfg = GPT2Config(**hf_config_kwargs(model_cfg, vocab_size=padded))
    hf_cfg._attn_implementation = "sdpa"
    hf = GPT2LMHeadModel(hf_cfg)
    missing, unexpected = hf.load_state_dict(
        canonical_to_hf(gather_full_state_dict(chunk), model_cfg, vocab_size=padded), strict=False
    )
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"weight conversion: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    hf.train()
    named = [(n, p) for n, p in hf.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if uses_weight_decay(n, p)], "weight_decay": optim.weight_decay},
        {"params": [p for n, p in named if not uses_weight_decay(n, p)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups, lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps
    )
    return hf, opt, padded


def plain_step(hf: torch.nn.Module, opt: torch.optim.Optimizer, task: Any, ps: Any, it: int) -> float:
    """One plain training iteration on our global batch ``it``; returns the loss."""
    mbs = task.microbatches("train", it, ps)  # the very samples our loop used
    tokens = sum(float(mb["loss_mask"].sum()) for mb in mbs)
    total = 0.0
    for mb in mbs:
        logits = hf(input_ids=mb["tokens"], position_ids=mb["position_ids"]).logits
        per_tok = F.cross_entropy(logits.float().flatten(0, 1), mb["labels"].flatten(), reduction="none")
        loss = (per_tok * mb["loss_mask"].flatten()).sum() / tokens
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="global batch (samples per iteration)")
    p.add_argument("--micro-batch", type=int, default=None, help="default: --batch (one microbatch)")
    p.add_argument("--vocab", type=int, default=1024, help="tiny BPE size (a multiple of 128 avoids padding)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=2, help="iterations per side excluded from timing")
    p.add_argument("--iters", type=int, default=15, help="timed iterations per side")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args()
    args.micro_batch = args.micro_batch or args.batch
    if args.threads:
        torch.set_num_threads(args.threads)

    from pretrain.training.cli import build_parser, build_task, configs_from_args
    from pretrain.training.loop import setup_parallel, train

    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        data = make_data(Path(tmp), args.vocab)
        cli_args = build_parser().parse_args(pretrain_argv(args, data))
        cfgs = configs_from_args(cli_args, world_size=1)
        task = build_task(cfgs)
        ps = setup_parallel(cfgs.parallel, seed=cfgs.train.seed)
        hf, opt, padded = build_plain(cfgs, task)

        times: dict[str, list[float]] = {"ours": [], "plain": []}
        cpu: dict[str, list[float]] = {"ours": [], "plain": []}
        losses: dict[str, list[float]] = {"ours": [], "plain": []}
        mark = [time.perf_counter(), time.process_time()]

        def on_iteration(record: dict[str, Any]) -> None:
            ours_s = time.perf_counter() - mark[0]  # our iteration incl. data, optimizer, logger
            ours_cpu = time.process_time() - mark[1]
            it = record["iteration"] - 1
            t, c = time.perf_counter(), time.process_time()
            plain_loss = plain_step(hf, opt, task, ps, it)
            plain_s, plain_cpu = time.perf_counter() - t, time.process_time() - c
            losses["ours"].append(record["loss"])
            losses["plain"].append(plain_loss)
            if it >= args.warmup:
                times["ours"].append(ours_s)
                times["plain"].append(plain_s)
                cpu["ours"].append(ours_cpu)
                cpu["plain"].append(plain_cpu)
            mark[:] = [time.perf_counter(), time.process_time()]

        train(task, ps=ps, optim_cfg=cfgs.optim, lr_cfg=cfgs.lr, cfg=cfgs.train, ckpt_args=None,
              on_iteration=on_iteration)  # fmt: skip

    tok = args.batch * args.seq
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    tps = {k: tok / v for k, v in med.items()}
    n_params = sum(p.numel() for p in hf.parameters())  # tied: embedding counted once (= ours)
    flops_per_token = model_flops_per_token(n_params, layers=args.layers, hidden=args.hidden, seq=args.seq)
    peak = matmul_peak_flops()
    result = {
        "ratio": tps["ours"] / tps["plain"],
        "ours_tokens_per_s": tps["ours"],
        "plain_tokens_per_s": tps["plain"],
        "peak_fraction": tps["ours"] * flops_per_token / peak,
        "plain_peak_fraction": tps["plain"] * flops_per_token / peak,
        "matmul_peak_gflops": peak / 1e9,
        "ours_iter_s_median": med["ours"],
        "plain_iter_s_median": med["plain"],
        "cpu_ratio": med_cpu["plain"] / med_cpu["ours"],
        "ours_iter_cpu_s_median": med_cpu["ours"],
        "plain_iter_cpu_s_median": med_cpu["plain"],
        "first_loss": {"ours": losses["ours"][0], "plain": losses["plain"][0]},
        "final_loss": {"ours": losses["ours"][-1], "plain": losses["plain"][-1]},
        "params": n_params,
        "shape": {
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "seq": args.seq,
            "batch": args.batch,
            "micro_batch": args.micro_batch,
            "vocab": padded,
        },  # fmt: skip
        "warmup": args.warmup,
        "iters": args.iters,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
    }
    print(
        f"{'loop':<8}{'iter s':>9}{'CPU s':>9}{'tokens/s':>11}{'peak frac':>11}{'loss 1st':>10}{'loss last':>11}"
    )
    for k in ("ours", "plain"):
        frac = result["peak_fraction" if k == "ours" else "plain_peak_fraction"]
        print(f"{k:<8}{med[k]:>9.3f}{med_cpu[k]:>9.3f}{tps[k]:>11.1f}{frac:>11.3f}"
              f"{losses[k][0]:>10.4f}{losses[k][-1]:>11.4f}")  # fmt: skip
    print(f"ratio ours/plain {result['ratio']:.3f} (wall), {result['cpu_ratio']:.3f} (CPU time); "
          f"matmul peak {peak / 1e9:.1f} GFLOP/s; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
