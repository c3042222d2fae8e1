"""Our LoRA training step vs a plain transformers + PEFT loop on the same Llama, batch, sequence, dtype.

The parent writes a random Llama (``save_pretrained``) and a PEFT LoRA adapter with PEFT's own
initialisation (B set to small random values so both sides start from the same non-trivial
adapter), then runs each side in its own fresh process (so peak RSS is that side's alone):

* ``ours``: the base read through ``tools.hf_io.open_hf`` and loaded one tensor at a time (as
  ``mlm-finetune sft --hf-model`` loads it), our ``GPTModel`` with ``add_lora``, the adapter read
  with ``from-hf --adapter``'s reader, our DDP wrapper and optimizer (AdamW, as the training loop
  builds them);
* ``theirs``: ``AutoModelForCausalLM`` + ``PeftModel.from_pretrained(is_trainable=True)`` and
  ``torch.optim.AdamW`` over the trainable parameters.

Both run the same ``--steps`` batches (the first ``--warmup`` steps are not timed: the first
compiles ``--fused-kernels``' loops, and the allocator settles in the next) with the same LR, no
clipping, no weight decay. ``--repeats N`` runs both sides N times back to back, alternating which
goes first, and reports medians of the paired ratios (a loaded host drifts between runs);
``--threads`` sets torch's threads in both (1 makes CPU time a clean measure on a shared host).
The last line is one JSON object: ``ratio`` (their step wall time over ours), ``cpu_ratio`` (their
process CPU time over ours), ``peak_rss_ratio`` (ours over theirs), ``loss_diff`` (|difference| of
the last step's loss), tokens/s, CPU s/step, peak and after-build RSS of both, the per-repeat
ratios and the settings; each side's line on stderr has its RSS after import, build and the first
step. ``--device cuda`` runs both on the GPU (peak GPU memory too).
Usage: ``python -m benchmarks.bench_lora [--size tiny|small|1b] [--steps N] [--warmup N] [--dtype float32|bfloat16]
[--repeats N] [--threads N]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import torch

from pretrain.config import CpuGemm

SIZES = {  # layers, hidden, heads, kv heads, ffn, vocab
    "tiny": (2, 64, 8, 2, 160, 1000),
    "small": (4, 512, 8, 2, 1376, 8000),
    "1b": (16, 2048, 32, 8, 5632, 32000),
}
LR = 1e-3
RANK, ALPHA = 16, 32.0
_LOCKSTEP = "LOCKSTEP"  # prefix of a side's replies to the parent in --lockstep mode
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


def _prompt_tokens(seq: int, loss_fraction: float) -> int:
    """The leading label positions of each row that carry no loss (an SFT prompt): all but the last
    ``loss_fraction`` of the ``seq`` positions."""
    return seq - max(1, round(seq * loss_fraction))


def _ours(
    workdir: Path, dtype: str, device: str, fused: bool, loss_fraction: float = 1.0, cpu_gemm: str = "auto"
) -> Callable[[torch.Tensor], float]:
    import dataclasses

    from finetune.init_from import TrunkTensors
    from pretrain.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads
    from pretrain.models.gpt import GPTModel
    from pretrain.models.lora import add_lora
    from pretrain.models.sharding import load_full_state_dict
    from pretrain.optim import OptimizerConfig, build_optimizer
    from pretrain.parallel.state import ParallelState
    from tools.convert.lora import read_peft_adapter
    from tools.hf_io import open_hf

    source = open_hf(workdir / "base")
    cfg = dataclasses.replace(source.spec.cfg, params_dtype=dtype, fused_kernels=fused,
                              cpu_gemm=cpu_gemm)  # --fused-kernels, --cpu-gemm  # fmt: skip
    ps = ParallelState.single(device=device, seed=0)
    model = GPTModel(cfg, ps)
    load_full_state_dict(model, TrunkTensors(source))  # streamed, one tensor at a time (as SFT loads)
    lora, adapters = read_peft_adapter(workdir / "adapter", cfg)
    add_lora(model, lora, seed=0)
    load_full_state_dict(model, adapters, strict=False)
    model.train()
    ddp = DistributedDataParallel(model, ps, DDPConfig(grad_reduce_in_fp32=True))
    # the optimizer sees only the float32 adapters beside the frozen base, as in mlm-finetune sft
    opt_cfg = OptimizerConfig(lr=LR, min_lr=LR, weight_decay=0.0, clip_grad=0.0)
    opt = build_optimizer(opt_cfg, [ddp], ps)
    opt.set_lr(LR)

    def step(ids: torch.Tensor) -> float:
        opt.zero_grad()
        # as mlm-finetune sft: the loss mask's tokens, their mean (finetune/sft/task.py)
        mask = torch.ones(ids.shape[0], ids.shape[1] - 1, device=ids.device)
        mask[:, : _prompt_tokens(mask.shape[1], loss_fraction)] = 0
        per_token = model(ids[:, :-1], labels=ids[:, 1:], loss_mask=mask).float()
        loss = (per_token * mask).sum() / mask.sum()
        opt.scale_loss(loss).backward()
        finalize_model_grads([ddp])
        opt.step()
        return float(loss)

    return step


def _theirs(
    workdir: Path, dtype: str, device: str, fused: bool, loss_fraction: float = 1.0, cpu_gemm: str = "auto"
) -> Callable[[torch.Tensor], float]:
    del fused, cpu_gemm  # transformers' Llama has no such switches: the plain loop (torch's own GEMMs)
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
        labels = ids[:, 1:].clone()
        labels[:, : _prompt_tokens(labels.shape[1], loss_fraction)] = -100  # transformers' ignore index
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
        )
        loss.backward()
        opt.step()
        return float(loss)

    return step


def _rss_mb() -> dict[str, float]:
    """This process's resident set now and at its peak (``/proc/self/status``; Linux), in MB."""
    fields = {"VmRSS": "rss_mb", "VmHWM": "peak_rss_mb"}
    out: dict[str, float] = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in fields:
                out[fields[key]] = int(value.split()[0]) / 1024
    return out


def _side(args: argparse.Namespace) -> None:
    """One side in this process: build, the warm-up steps, then the timed steps (wall and CPU time)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    phases = {"import": _rss_mb()}
    batches = _batches(args.steps, args.batch, args.seq, SIZES[args.size][5], args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    step = (_ours if args.side == "ours" else _theirs)(
        args.workdir, args.dtype, args.device, args.fused_kernels == "on", args.loss_fraction, args.cpu_gemm
    )
    phases["built"] = _rss_mb()
    losses = [step(b) for b in batches[: args.warmup]]
    phases["warmed_up"] = _rss_mb()
    sync()
    if args.lockstep:
        seconds, cpu, each = _lockstep_steps(step, batches[args.warmup :], losses, sync)
    else:
        t0, c0 = time.perf_counter(), time.process_time()
        losses += [step(b) for b in batches[args.warmup :]]
        sync()
        seconds, cpu, each = time.perf_counter() - t0, time.process_time() - c0, []
    peak_gpu = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"side": args.side, "losses": losses, "steps_s": seconds, "cpu_s": cpu, "peak_rss_mb": rss,
                      "rss_phases": phases, "peak_gpu_mb": peak_gpu, "step_s": each}))  # fmt: skip


def _lockstep_steps(
    step: Callable[[torch.Tensor], float], batches: list[torch.Tensor], losses: list[float],
    sync: Callable[[], None],
) -> tuple[float, float, list[float]]:  # fmt: skip
    """The timed steps, each when the parent says ``step`` on stdin (the other side idle
    meanwhile), each step's wall and CPU seconds reported back at once: total wall, total CPU,
    each step's wall."""
    print(f"{_LOCKSTEP} ready", flush=True)
    seconds = cpu = 0.0
    each: list[float] = []
    for b in batches:
        if sys.stdin.readline().strip() != "step":
            sys.exit("bench_lora --lockstep: the parent stopped before the last step")
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step(b))
        sync()
        wall, used = time.perf_counter() - t0, time.process_time() - c0
        seconds, cpu = seconds + wall, cpu + used
        each.append(wall)
        print(f"{_LOCKSTEP} {wall} {used}", flush=True)
    # stay until the parent is done with both sides: a side that exits (freeing its memory) while
    # the other still runs its last step slows that step (1.6 s against 0.6)
    sys.stdin.readline()
    return seconds, cpu, each


def _side_argv(side: str, work: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "benchmarks.bench_lora", "--side", side, "--workdir", str(work),
            "--size", args.size, "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq", str(args.seq),
            "--dtype", args.dtype, "--device", args.device, "--threads", str(args.threads),
            "--fused-kernels", args.fused_kernels, "--loss-fraction", str(args.loss_fraction),
            "--cpu-gemm", args.cpu_gemm]  # fmt: skip


def _run_side(side: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One side alone in its own process, all its steps in a row (``--schedule sequential``)."""
    argv = _side_argv(side, work, args)
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"{side} failed:\n{out.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{side}: {res}", file=sys.stderr)
    return res


def _run_interleaved(work: Path, args: argparse.Namespace, first: str) -> dict[str, dict[str, Any]]:
    """Both sides at once, each in its own process, built and warmed up side by side; then their
    timed steps one at a time in turn (``first``'s step, the other's, the other's, ``first``'s,
    ...), the idle side waiting on its stdin: a host whose speed drifts over seconds slows both
    sides' steps alike, which back-to-back runs of minutes do not (``--schedule interleaved``)."""
    sides = (first, "theirs" if first == "ours" else "ours")
    with tempfile.TemporaryFile("w+") as err0, tempfile.TemporaryFile("w+") as err1:
        errs = dict(zip(sides, (err0, err1), strict=True))
        procs = {
            side: subprocess.Popen(
                [*_side_argv(side, work, args), "--lockstep"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errs[side],
                text=True,
            )
            for side in sides
        }
        try:
            for side in sides:
                _reply(procs[side], side, errs[side])
            for i in range(args.steps - args.warmup):
                for side in sides if i % 2 == 0 else sides[::-1]:
                    assert procs[side].stdin is not None
                    procs[side].stdin.write("step\n")
                    procs[side].stdin.flush()
                    _reply(procs[side], side, errs[side])
            out = {}
            for side in sides:
                stdout, _ = procs[side].communicate()
                out[side] = json.loads(stdout.strip().splitlines()[-1])
                print(f"{side}: {out[side]}", file=sys.stderr)
            return out
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()


def _reply(proc: subprocess.Popen[str], side: str, err: Any) -> str:
    """The side's next ``--lockstep`` line (other output skipped); exits with its stderr if it died."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(_LOCKSTEP):
            return line[len(_LOCKSTEP) :].strip()
    proc.wait()
    err.seek(0)
    sys.exit(f"{side} failed:\n{err.read()[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=12, help="steps per side (warm-up included)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--repeats", type=int, default=1, help="back-to-back runs of both sides (medians reported)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads per side (0: torch's default)")
    p.add_argument("--fused-kernels", choices=("on", "off"), default="on",
                   help="our side as mlm-finetune sft --fused-kernels (default) or without it")  # fmt: skip
    p.add_argument("--cpu-gemm", choices=get_args(CpuGemm), default="auto",
                   help="our side's frozen fp32 GEMM library on the CPU, as mlm-finetune sft --cpu-gemm "
                   "(auto: oneDNN on x86 CPUs not made by Intel, else MKL)")  # fmt: skip
    p.add_argument("--schedule", choices=("interleaved", "sequential"), default="interleaved",
                   help="interleaved: both sides' processes at once, their timed steps in turn (default); "
                   "sequential: one side's whole run, then the other's")  # fmt: skip
    p.add_argument("--loss-fraction", type=float, default=1.0,
                   help="the trailing fraction of each row's tokens that carry loss (an SFT completion after "
                   "its prompt; 1: every token)")  # fmt: skip
    p.add_argument("--side", choices=("ours", "theirs"), help=argparse.SUPPRESS)
    p.add_argument("--lockstep", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not 0.0 < args.loss_fraction <= 1.0:
        p.error(f"--loss-fraction must be in (0, 1], got {args.loss_fraction}")
    if not 1 <= args.warmup < args.steps:
        p.error(f"--warmup must be at least 1 and below --steps ({args.steps}), got {args.warmup}")
    if args.side is not None:
        _side(args)
        return
    pairs: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _prepare(work, args.size)
        for i in range(args.repeats):  # alternate which side runs first: drifting load hits both
            order = ("theirs", "ours") if i % 2 == 0 else ("ours", "theirs")
            if args.schedule == "interleaved":
                pairs.append(_run_interleaved(work, args, order[0]))
            else:
                pairs.append({side: _run_side(side, work, args) for side in order})
    print(json.dumps(_summary(pairs, args)))


def _summary(pairs: list[dict[str, dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    """Medians over the repeats of the paired ratios (each pair ran back to back) and of each side."""

    def med(f: Callable[[dict[str, dict[str, Any]]], float]) -> float:
        return float(statistics.median(f(p) for p in pairs))

    timed = args.steps - args.warmup
    tokens = args.batch * args.seq * timed
    gpu = {s: pairs[-1][s]["peak_gpu_mb"] for s in ("ours", "theirs")}
    return {
        "ratio": med(lambda p: p["theirs"]["steps_s"] / p["ours"]["steps_s"]),
        "cpu_ratio": med(lambda p: p["theirs"]["cpu_s"] / p["ours"]["cpu_s"]),
        "peak_rss_ratio": med(lambda p: p["ours"]["peak_rss_mb"] / p["theirs"]["peak_rss_mb"]),
        "loss_diff": max(abs(p["ours"]["losses"][-1] - p["theirs"]["losses"][-1]) for p in pairs),
        "ours_tokens_per_s": med(lambda p: tokens / p["ours"]["steps_s"]),
        "theirs_tokens_per_s": med(lambda p: tokens / p["theirs"]["steps_s"]),
        "ours_cpu_s_per_step": med(lambda p: p["ours"]["cpu_s"]) / timed,
        "theirs_cpu_s_per_step": med(lambda p: p["theirs"]["cpu_s"]) / timed,
        "ours_peak_rss_mb": med(lambda p: p["ours"]["peak_rss_mb"]),
        "theirs_peak_rss_mb": med(lambda p: p["theirs"]["peak_rss_mb"]),
        "ours_built_rss_mb": med(lambda p: p["ours"]["rss_phases"]["built"]["rss_mb"]),
        "theirs_built_rss_mb": med(lambda p: p["theirs"]["rss_phases"]["built"]["rss_mb"]),
        "ours_peak_gpu_mb": gpu["ours"], "theirs_peak_gpu_mb": gpu["theirs"],
        "step_ratio_median": _step_ratio_median(pairs),
        "ratios": [round(p["theirs"]["steps_s"] / p["ours"]["steps_s"], 3) for p in pairs],
        "cpu_ratios": [round(p["theirs"]["cpu_s"] / p["ours"]["cpu_s"], 3) for p in pairs],
        "size": args.size, "steps": args.steps, "warmup": args.warmup, "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
        "device": args.device, "fused_kernels": args.fused_kernels == "on", "rank": RANK, "repeats": args.repeats, "threads": args.threads or torch.get_num_threads(),
        "schedule": args.schedule, "loss_fraction": args.loss_fraction,
        "cpu_gemm": args.cpu_gemm, "cpu_gemm_library": _cpu_gemm_library(args), "cpu_vendor": _cpu_vendor(),
        "loss_tokens_per_row": args.seq - _prompt_tokens(args.seq, args.loss_fraction),
    }  # fmt: skip


def _cpu_gemm_library(args: argparse.Namespace) -> str | None:
    """What ``--cpu-gemm`` ran as on our side (None on a GPU)."""
    from pretrain.models.cpu_gemm import resolve

    return resolve(args.cpu_gemm) if args.device == "cpu" else None


def _cpu_vendor() -> str | None:
    from pretrain.models.cpu_gemm import cpu_vendor

    return cpu_vendor()


def _step_ratio_median(pairs: list[dict[str, dict[str, Any]]]) -> float | None:
    """Interleaved runs: the median over every pair of neighbouring steps (step ``i`` of each side)
    of their wall time over ours; None for sequential runs (no such pairs)."""
    ratios = [t / o for p in pairs for o, t in zip(p["ours"]["step_s"], p["theirs"]["step_s"], strict=True)]
    return round(statistics.median(ratios), 3) if ratios else None


if __name__ == "__main__":
    main()
