"""Forward+backward tokens/s of our GPT (tp=1) against Hugging Face ``GPT2LMHeadModel``.

Both models get the same shape and the same weights (ours converted through the canonical
mapping), the same batch, dropout off, SDPA attention, fp32. Steps alternate between the two so
that machine noise hits both alike; the median step time of each is compared. Also measures the
machine's matmul peak (median of large fp32 GEMMs) and reports the fraction of it each model
achieves (model FLOPs = 6 N + 12 L h s per token, N = non-embedding + embedding parameters
used in matmuls).

    python benchmarks/bench_gpt_step.py                   # GPT-2 small, seq 1024 (default)
    python benchmarks/bench_gpt_step.py --layers 2 --seq 128 --steps 2   # quick

Last line: ``{"ratio": ours/HF tokens per second, "peak_fraction": ..., ...}``.
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
    )  # fmt: skip
    ours = GPTModel(cfg, ParallelState.single())
    init_model_parameters(ours, seed=0)
    hf_cfg = GPT2Config(
        vocab_size=args.vocab, n_positions=max(1024, args.seq), n_embd=args.hidden, n_layer=args.layers,
        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
        activation_function="gelu_new",
    )  # fmt: skip
    hf = GPT2LMHeadModel(hf_cfg)
    hf.config._attn_implementation = "sdpa"
    try:
        from pretrain.models.hf_gpt2 import canonical_to_hf

        hf.load_state_dict(canonical_to_hf(gather_full_state_dict(ours), cfg), strict=False)
        same_weights = True
    except ImportError:  # converter not available: same shapes, independent init
        same_weights = False
    return cfg, ours, hf, same_weights


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
    args = p.parse_args()
    torch.manual_seed(0)
    cfg, ours, hf, same = build_models(args)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    labels = tokens.roll(-1, dims=1)
    hf_labels = tokens  # HF shifts internally
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    for i in range(args.steps + 1):  # step 0 warms up both
        for name, fn, model, lab in (("ours", step_ours, ours, labels), ("hf", step_hf, hf, hf_labels)):
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            fn(model, tokens, lab)
            if i > 0:
                times[name].append(time.perf_counter() - t)
    tok = args.batch * args.seq
    tps = {k: tok / statistics.median(v) for k, v in times.items()}
    n_params = sum(p.numel() for p in ours.parameters())
    flops_per_token = model_flops_per_token(
        n_params, layers=cfg.num_layers, hidden=cfg.hidden_size, seq=args.seq
    )
    peak = matmul_peak_flops()
    result = {
        "ratio": tps["ours"] / tps["hf"],
        "ours_tokens_per_s": tps["ours"],
        "hf_tokens_per_s": tps["hf"],
        "peak_fraction": tps["ours"] * flops_per_token / peak,
        "hf_peak_fraction": tps["hf"] * flops_per_token / peak,
        "matmul_peak_gflops": peak / 1e9,
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
