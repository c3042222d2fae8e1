"""Model FLOPs utilisation of a training step on one device: a ~1.2B GPT-2-shape and a ~1B
Llama-shape model in bf16, ours against transformers' model of the same shape in a plain loop.

Each step is forward, backward and an AdamW update (``torch.optim.AdamW``, the same for both
models), with SDPA attention (flash on a GPU) and dropout off. Steps alternate between the two
models so machine noise hits both alike; median step times are compared.

* ``mfu``: model FLOPs per step (Megatron's formula, :func:`pretrain.training.flops.gpt_flops_per_iteration`:
  3 passes, GQA, SwiGLU, the logits layer) over step time, divided by the device's dense peak
  (:data:`benchmarks.bench_gpt_step.GPU_PEAK_TFLOPS`; ``--peak-tflops`` for others; on the CPU the
  measured matmul peak of the dtype);
* ``ratio``: our tokens per second over transformers'.

    python benchmarks/bench_mfu.py             # on a GPU: both presets, bf16
    python benchmarks/bench_mfu.py --smoke     # CPU: tiny shapes, 2 steps (what the test runs)
    python benchmarks/bench_mfu.py --profile DIR   # also each model's top kernels (ours, 2 steps)
    python benchmarks/bench_mfu.py --fused-kernels # ours with the compiled RMSNorm/SwiGLU loops

Last line JSON: ``{"mfu": lowest of the models, "ratio": lowest, "device": ..., "models": {name:
{"mfu", "hf_mfu", "ratio", "tokens_per_s", "hf_tokens_per_s", "params", "shape"}}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:  # run as ``python benchmarks/<script>.py`` (benchmarks/ on sys.path) or as a module
    from bench_gpt_step import gpu_peak_flops
    from common import matmul_peak_flops
except ImportError:
    from benchmarks.bench_gpt_step import gpu_peak_flops
    from benchmarks.common import matmul_peak_flops

# layers, hidden, heads, query groups, ffn, vocab, sequence, micro batch
PRESETS: dict[str, dict[str, dict[str, int]]] = {
    "full": {
        "gpt2_1.2b": dict(layers=24, hidden=2048, heads=16, groups=16, ffn=8192, vocab=50257, seq=2048, batch=8),
        "llama_1b": dict(layers=16, hidden=2048, heads=32, groups=8, ffn=8192, vocab=128256, seq=2048, batch=8),
    },
    "smoke": {
        "gpt2_1.2b": dict(layers=2, hidden=64, heads=4, groups=4, ffn=256, vocab=512, seq=32, batch=2),
        "llama_1b": dict(layers=2, hidden=64, heads=4, groups=2, ffn=160, vocab=512, seq=32, batch=2),
    },
}  # fmt: skip


def model_config(name: str, shape: dict[str, int], dtype: str, fused_kernels: bool = False) -> Any:
    from pretrain.config import ModelConfig

    common = dict(fused_kernels=fused_kernels, num_layers=shape["layers"], hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
                  vocab_size=shape["vocab"], max_position_embeddings=shape["seq"], ffn_hidden_size=shape["ffn"],
                  hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype)  # fmt: skip
    if name.startswith("gpt2"):
        return ModelConfig(**common)  # type: ignore[arg-type]
    return ModelConfig(**common, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",  # type: ignore[arg-type]
                       num_query_groups=shape["groups"], add_bias_linear=False, rotary_base=500000.0)  # fmt: skip


def hf_model(name: str, shape: dict[str, int]) -> Any:
    """transformers' model of the same shape (its own initialisation; throughput does not depend on values)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if name.startswith("gpt2"):
        cfg: Any = GPT2Config(vocab_size=shape["vocab"], n_positions=shape["seq"], n_embd=shape["hidden"],
                              n_layer=shape["layers"], n_head=shape["heads"], n_inner=shape["ffn"], resid_pdrop=0.0,
                              embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new")  # fmt: skip
        model: Any = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                          num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                          num_key_value_heads=shape["groups"], max_position_embeddings=shape["seq"],
                          rope_theta=500000.0, tie_word_embeddings=True)  # fmt: skip
        model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model


def _stepper(model: torch.nn.Module, loss: Callable[[], torch.Tensor]) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss().backward()
        opt.step()

    return step


def measure(name: str, shape: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    from pretrain.models.gpt import GPTModel
    from pretrain.models.init import init_model_parameters
    from pretrain.parallel.state import ParallelState
    from pretrain.training.flops import gpt_flops_per_iteration

    cfg = model_config(name, shape, args.dtype, args.fused_kernels)
    ours = GPTModel(cfg, ParallelState.single(device=args.device))
    init_model_parameters(ours, seed=0)
    hf = hf_model(name, shape).to(device=args.device, dtype=getattr(torch, args.dtype))
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=args.device)
    labels = tokens.roll(-1, dims=1)
    steps = {
        "ours": _stepper(ours, lambda: ours(tokens, labels=labels).float().mean()),
        "hf": _stepper(hf, lambda: hf(input_ids=tokens, labels=tokens).loss),  # HF shifts internally
    }
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    for i in range(args.steps + 1):  # step 0 warms up both
        for who, step in steps.items():
            _sync(args.device)
            t = time.perf_counter()
            step()
            _sync(args.device)
            if i:
                times[who].append(time.perf_counter() - t)
    flops = gpt_flops_per_iteration(cfg, global_batch=shape["batch"], seq_length=shape["seq"],
                                    padded_vocab=ours.padded_vocab)  # fmt: skip
    secs = {k: statistics.median(v) for k, v in times.items()}
    if args.profile:
        _profile(steps["ours"], args.profile / f"mfu_profile_{name}.txt", args.device)
    tok = shape["batch"] * shape["seq"]
    return {
        "mfu": flops / secs["ours"] / args.peak, "hf_mfu": flops / secs["hf"] / args.peak,
        "ratio": secs["hf"] / secs["ours"], "tokens_per_s": tok / secs["ours"], "hf_tokens_per_s": tok / secs["hf"],
        "flops_per_step": flops, "params": sum(p.numel() for p in ours.parameters()),
        "shape": shape,
    }  # fmt: skip


def _profile(step: Callable[[], None], path: Path, device: str) -> None:
    """Where our step's time goes: ``torch.profiler`` over two steps, the top 40 ops by self
    device time (CPU time on the CPU), written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
        _sync(device)
    sort = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=90))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes (the CPU check that keeps the bench alive)"
    )
    p.add_argument("--model", choices=sorted(PRESETS["full"]), action="append", help="default: both")
    p.add_argument("--steps", type=int, help="timed steps per model (default 10; 2 with --smoke)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--peak-tflops", type=float, help="the device's dense peak, if not in the table")
    p.add_argument("--fused-kernels", action="store_true",
                   help="ours with the compiled RMSNorm/SwiGLU loops (mlm-pretrain --fused-kernels)")  # fmt: skip
    p.add_argument("--profile", type=Path, metavar="DIR", help="write our step's top ops per model here")
    args = p.parse_args(argv)
    args.steps = args.steps or (2 if args.smoke else 10)
    on_gpu = args.device.startswith("cuda")
    device = torch.cuda.get_device_name(torch.device(args.device)) if on_gpu else "cpu"
    if on_gpu:
        peak = gpu_peak_flops(device, args.dtype, args.peak_tflops)
    else:
        peak = (
            args.peak_tflops * 1e12
            if args.peak_tflops
            else matmul_peak_flops(512 if args.smoke else 2048, dtype=getattr(torch, args.dtype))
        )
    args.peak = peak or float("nan")
    presets = PRESETS["smoke" if args.smoke else "full"]
    models = {name: measure(name, presets[name], args) for name in (args.model or sorted(presets))}
    for name, r in models.items():
        print(f"{name:<10} ours {r['tokens_per_s']:>10.1f} tok/s  mfu {r['mfu']:.3f}   "
              f"transformers {r['hf_tokens_per_s']:>10.1f} tok/s  mfu {r['hf_mfu']:.3f}   ratio {r['ratio']:.3f}")  # fmt: skip
    result = {
        "mfu": min(r["mfu"] for r in models.values()),
        "ratio": min(r["ratio"] for r in models.values()),
        "device": device, "dtype": args.dtype, "peak_tflops": args.peak / 1e12, "smoke": args.smoke,
        "fused_kernels": args.fused_kernels,
        "models": models,
    }  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
