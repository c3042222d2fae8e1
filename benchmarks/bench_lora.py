"""Our LoRA training step vs a plain transformers + PEFT loop on the same Llama, batch, sequence, dtype.

The parent writes a random Llama (``save_pretrained``) and a PEFT LoRA adapter with PEFT's own
initialisation (B set to small random values so both sides start from the same non-trivial
adapter), then runs each side in its own fresh process (so peak RSS is that side's alone):

* ``ours``: the base read through ``tools.hf_io.open_hf``, our ``GPTModel`` with ``add_lora``, the
  adapter read with ``from-hf --adapter``'s reader, our DDP wrapper and optimizer (AdamW, as the
  training loop builds them);
* ``theirs``: ``AutoModelForCausalLM`` + ``PeftModel.from_pretrained(is_trainable=True)`` and
  ``torch.optim.AdamW`` over the trainable parameters.

Both run the same ``--steps`` batches (the first step is warm-up, not timed) with the same LR, no
clipping, no weight decay. The last line is one JSON object: ``ratio`` (their step time over ours),
``peak_rss_ratio`` (ours over theirs), ``loss_diff`` (|difference| of the last step's loss),
tokens/s of both, and the settings. ``--device cuda`` runs both on the GPU (peak GPU memory too).
Usage: ``python -m benchmarks.bench_lora [--size tiny|small|1b] [--steps N] [--dtype float32|bfloat16]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

SIZES = {  # layers, hidden, heads, kv heads, ffn, vocab
    "tiny": (2, 64, 8, 2, 160, 1000),
    "small": (4, 512, 8, 2, 1376, 8000),
    "1b": (16, 2048, 32, 8, 5632, 32000),
}
LR = 1e-3
RANK, ALPHA = 16, 32.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _prepare(workdir: Path, size: str) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, heads, kv, ffn, vocab = SIZES[size]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                      tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(workdir / "base")
    peft = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.01)
    peft.save_pretrained(workdir / "adapter")


def _batches(steps: int, batch: int, seq: int, vocab: int, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device) for _ in range(steps)]


def _ours(workdir: Path, dtype: str, device: str) -> Callable[[torch.Tensor], float]:
    import dataclasses

    from pretrain.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads
    from pretrain.models.gpt import GPTModel
    from pretrain.models.lora import add_lora
    from pretrain.models.sharding import load_full_state_dict
    from pretrain.optim import OptimizerConfig, build_optimizer
    from pretrain.parallel.state import ParallelState
    from tools.convert.lora import read_peft_adapter
    from tools.hf_io import open_hf

    source = open_hf(workdir / "base")
    cfg = dataclasses.replace(source.spec.cfg, params_dtype=dtype)
    ps = ParallelState.single(device=device, seed=0)
    model = GPTModel(cfg, ps)
    load_full_state_dict(model, {n: source.tensor(n) for n in source.names()})
    lora, adapters = read_peft_adapter(workdir / "adapter", cfg)
    add_lora(model, lora, seed=0)
    load_full_state_dict(model, adapters, strict=False)
    model.train()
    ddp = DistributedDataParallel(model, ps, DDPConfig(grad_reduce_in_fp32=True))
    opt_cfg = OptimizerConfig(lr=LR, min_lr=LR, weight_decay=0.0, clip_grad=0.0, bf16=dtype == "bfloat16")
    opt = build_optimizer(opt_cfg, [ddp], ps)
    opt.set_lr(LR)

    def step(ids: torch.Tensor) -> float:
        opt.zero_grad()
        loss = model(ids[:, :-1], labels=ids[:, 1:]).float().mean()
        opt.scale_loss(loss).backward()
        finalize_model_grads([ddp])
        opt.step()
        return float(loss)

    return step


def _theirs(workdir: Path, dtype: str, device: str) -> Callable[[torch.Tensor], float]:
    import torch.nn.functional as F
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(workdir / "base", dtype=getattr(torch, dtype)).to(device)
    model = PeftModel.from_pretrained(base, workdir / "adapter", is_trainable=True)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)

    def step(ids: torch.Tensor) -> float:
        opt.zero_grad()
        logits = model(ids[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        return float(loss)

    return step


def _side(args: argparse.Namespace) -> None:
    """One side in this process: build, one warm-up step, then the timed steps."""
    batches = _batches(args.steps, args.batch, args.seq, SIZES[args.size][5], args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    step = (_ours if args.side == "ours" else _theirs)(args.workdir, args.dtype, args.device)
    losses = [step(batches[0])]
    sync()
    t0 = time.perf_counter()
    losses += [step(b) for b in batches[1:]]
    sync()
    seconds = time.perf_counter() - t0
    peak_gpu = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"side": args.side, "losses": losses, "steps_s": seconds, "peak_rss_mb": rss,
                      "peak_gpu_mb": peak_gpu}))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=6, help="steps per side (the first is warm-up)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--side", choices=("ours", "theirs"), help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side is not None:
        _side(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _prepare(work, args.size)
        res = {}
        for side in ("theirs", "ours"):
            argv = [sys.executable, "-m", "benchmarks.bench_lora", "--side", side, "--workdir", str(work),
                    "--size", args.size, "--steps", str(args.steps), "--batch", str(args.batch),
                    "--seq", str(args.seq), "--dtype", args.dtype, "--device", args.device]  # fmt: skip
            out = subprocess.run(argv, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                sys.exit(f"{side} failed:\n{out.stderr[-3000:]}")
            res[side] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{side}: {res[side]}", file=sys.stderr)
    ours, theirs = res["ours"], res["theirs"]
    tokens = args.batch * args.seq * (args.steps - 1)
    print(json.dumps({
        "ratio": theirs["steps_s"] / ours["steps_s"],
        "peak_rss_ratio": ours["peak_rss_mb"] / theirs["peak_rss_mb"],
        "loss_diff": abs(ours["losses"][-1] - theirs["losses"][-1]),
        "ours_tokens_per_s": tokens / ours["steps_s"], "theirs_tokens_per_s": tokens / theirs["steps_s"],
        "ours_peak_rss_mb": ours["peak_rss_mb"], "theirs_peak_rss_mb": theirs["peak_rss_mb"],
        "ours_peak_gpu_mb": ours["peak_gpu_mb"], "theirs_peak_gpu_mb": theirs["peak_gpu_mb"],
        "size": args.size, "steps": args.steps, "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
        "device": args.device, "rank": RANK,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
