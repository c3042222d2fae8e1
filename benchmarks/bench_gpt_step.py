"""Forward+backward tokens/s of our GPT (tp=1) against Hugging Face ``GPT2LMHeadModel``.

Both models get the same shape and the same weights (ours converted through the canonical
mapping), the same batch, dropout off, SDPA attention, fp32 on the CPU (bf16 on a GPU). Steps alternate between the two so
that machine noise hits both alike; the median step time of each is compared. Also measures the
machine's matmul peak (median of large fp32 GEMMs) and reports the fraction of it each model
achieves (model FLOPs = 6 N + 12 L h s per token, N = non-embedding + embedding parameters
used in matmuls).

    python benchmarks/bench_gpt_step.py                   # GPT-2 small, seq 1024 (default)
    python benchmarks/bench_gpt_step.py --layers 2 --seq 128 --steps 2   # quick
    python benchmarks/bench_gpt_step.py --size 1.2b       # on a GPU: ~1.2B GPT, bf16, batch 8

On CUDA the peak is the GPU's dense bf16 (or fp16/fp32) tensor-core peak from a table of known
GPUs (:data:`GPU_PEAK_TFLOPS`; ``--peak-tflops`` for others), so ``mfu`` is the model FLOPs
utilisation Megatron-LM reports; on the CPU it is the fraction of the measured fp32 matmul peak.

Last line: ``{"ratio": ours/HF tokens per second, "mfu": ..., "device": ..., "peak_fraction": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:  # run as ``python benchmarks/<script>.py`` (benchmarks/ on sys.path) or as a module
    from common import matmul_peak_flops, model_flops_per_token
except ImportError:
    from benchmarks.common import matmul_peak_flops, model_flops_per_token


# Dense (no sparsity) tensor-core peaks in TFLOP/s: {name fragment: {dtype: peak}}; first match wins.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989.0, "float16": 989.0, "float32": 494.5},
    "H100": {"bfloat16": 989.0, "float16": 989.0, "float32": 494.5},  # SXM; TF32 for fp32
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0},
    "V100": {"bfloat16": 125.0, "float16": 125.0, "float32": 15.7},  # no bf16 units: fp16 figure
}
SIZES = {"1.2b": {"layers": 24, "hidden": 2048, "heads": 16, "seq": 1024, "batch": 8}}


def gpu_peak_flops(device_name: str, dtype: str, override_tflops: float | None) -> float | None:
    """The GPU's dense peak FLOP/s for ``dtype`` (None: not in the table and no override)."""
    if override_tflops:
        return override_tflops * 1e12
    for fragment, peaks in GPU_PEAK_TFLOPS.items():
        if fragment in device_name:
            return peaks[dtype] * 1e12
    return None


def build_models(args: argparse.Namespace):
    from transformers import GPT2Config, GPT2LMHeadModel

    from pretrain.config import ModelConfig
    from pretrain.models.gpt import GPTModel
    from pretrain.models.init import init_model_parameters
    from pretrain.models.sharding import gather_full_state_dict
    from pretrain.parallel.state import ParallelState

    cfg = ModelConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, vocab_size=args.vocab,
        max_position_embeddings=max(1024, args.seq), hidden_dropout=0.0, attention_dropout=0.0, gelu="tanh",
        params_dtype=args.dtype,
    )  # fmt: skip
    ours = GPTModel(cfg, ParallelState.single(device=args.device))
    init_model_parameters(ours, seed=0)
    hf_cfg = GPT2Config(
        vocab_size=args.vocab, n_positions=max(1024, args.seq), n_embd=args.hidden, n_layer=args.layers,
        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
        activation_function="gelu_new",
    )  # fmt: skip
    hf = GPT2LMHeadModel(hf_cfg)
    hf.config._attn_implementation = "sdpa"
    try:
        from pretrain.models.families.gpt2 import canonical_to_hf

        hf.load_state_dict(canonical_to_hf(gather_full_state_dict(ours), cfg), strict=False)
        same_weights = True
    except ImportError:  # converter not available: same shapes, independent init
        same_weights = False
    return cfg, ours, hf.to(device=args.device, dtype=getattr(torch, args.dtype)), same_weights


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_ours(model, tokens, labels) -> None:
    model(tokens, labels=labels).mean().backward()


def step_hf(model, tokens, labels) -> None:
    model(input_ids=tokens, labels=labels).loss.backward()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--size", choices=sorted(SIZES), help="preset shape (1.2b: 24 x 2048, 16 heads, batch 8)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default bf16 on CUDA, fp32 on CPU"
    )
    p.add_argument("--peak-tflops", type=float, help="the accelerator's dense peak, if not in the table")
    args = p.parse_args()
    for k, v in SIZES.get(args.size or "", {}).items():
        setattr(args, k, v)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 runs as TF32, as the peak table assumes
    torch.manual_seed(0)
    cfg, ours, hf, same = build_models(args)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    labels = tokens.roll(-1, dims=1)
    hf_labels = tokens  # HF shifts internally
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    for i in range(args.steps + 1):  # step 0 warms up both
        for name, fn, model, lab in (("ours", step_ours, ours, labels), ("hf", step_hf, hf, hf_labels)):
            model.zero_grad(set_to_none=True)
            sync(args.device)
            t = time.perf_counter()
            fn(model, tokens, lab)
            sync(args.device)
            if i > 0:
                times[name].append(time.perf_counter() - t)
    tok = args.batch * args.seq
    tps = {k: tok / statistics.median(v) for k, v in times.items()}
    n_params = sum(p.numel() for p in ours.parameters())
    flops_per_token = model_flops_per_token(
        n_params, layers=cfg.num_layers, hidden=cfg.hidden_size, seq=args.seq
    )
    on_gpu = args.device.startswith("cuda")
    device = torch.cuda.get_device_name(torch.device(args.device)) if on_gpu else "cpu"
    peak = gpu_peak_flops(device, args.dtype, args.peak_tflops) if on_gpu else matmul_peak_flops()
    peak = peak or float("nan")
    result = {
        "ratio": tps["ours"] / tps["hf"],
        "mfu": tps["ours"] * flops_per_token / peak,
        "hf_mfu": tps["hf"] * flops_per_token / peak,
        "device": device,
        "dtype": args.dtype,
        "params": n_params,
        "ours_tokens_per_s": tps["ours"],
        "hf_tokens_per_s": tps["hf"],
        "peak_fraction": tps["ours"] * flops_per_token / peak,
        "hf_peak_fraction": tps["hf"] * flops_per_token / peak,
        "matmul_peak_gflops": peak / 1e9,  # GPU: the table's dense peak; CPU: measured fp32 GEMMs
        "same_weights": same,
        "shape": {
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "seq": args.seq,
            "batch": args.batch,
        },
        "threads": torch.get_num_threads(),
    }
    print(f"{'model':<8}{'tokens/s':>12}{'peak frac':>12}")
    print(f"{'ours':<8}{tps['ours']:>12.1f}{result['peak_fraction']:>12.3f}")
    print(f"{'HF':<8}{tps['hf']:>12.1f}{result['hf_peak_fraction']:>12.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
