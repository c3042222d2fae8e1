"""Forward+backward time of our mixture-of-experts decoder against transformers' ``MixtralForCausalLM``.

Both get the same Mixtral shape and the same weights (HF's read into ours by the Mixtral converter,
as ``mlm-convert from-hf`` does), the same batch,
dropout off, SDPA attention and the same dtype. Steps alternate between the two so that machine
noise hits both alike; the median step times are compared. Also checks that the two losses agree.

    python benchmarks/bench_moe_step.py                  # 4 layers, h 512, 8 experts top-2, seq 512
    python benchmarks/bench_moe_step.py --quick          # tiny shapes (a smoke test)

Last line: ``{"ratio": HF step time / ours (>1: we are faster), "loss_diff": ..., ...}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(args: argparse.Namespace):
    """``(ours, hf)`` with identical weights."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from pretrain.models.families import moe
    from pretrain.models.families.registry import family_of_model_type
    from pretrain.models.gpt import GPTModel
    from pretrain.models.sharding import load_full_state_dict
    from pretrain.parallel.state import ParallelState

    hf_cfg = MixtralConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, num_local_experts=args.experts,
        num_experts_per_tok=args.topk, max_position_embeddings=args.seq, rms_norm_eps=1e-5, tie_word_embeddings=False,
        router_aux_loss_coef=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    hf = MixtralForCausalLM(hf_cfg).to(getattr(torch, args.dtype))
    # the Mixtral converter (pretrain.models.families.moe): config and tensors exactly as from-hf reads them
    family = family_of_model_type("mixtral")
    assert family is not None
    cfg = dataclasses.replace(
        moe.config_from_hf(hf.config, family),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=args.dtype,
    )
    full = {n: make() for n, make in moe.lazy_hf_to_canonical(hf.state_dict(), cfg, "mixtral").items()}
    ours = GPTModel(cfg, ParallelState.single())
    load_full_state_dict(ours, full)
    return ours.train(), hf.train()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 4), ("hidden", 512), ("heads", 8), ("kv-heads", 2), ("ffn", 1024),
                          ("experts", 8), ("topk", 2), ("vocab", 32000), ("seq", 512), ("batch", 2), ("steps", 3)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test")
    args = p.parse_args()
    if args.quick:
        args.layers, args.hidden, args.heads, args.kv_heads, args.ffn = 2, 64, 4, 2, 96
        args.experts, args.vocab, args.seq, args.batch, args.steps = 4, 500, 32, 2, 2
    ours, hf = build(args)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    labels = tokens.roll(-1, dims=1)  # ours: position t predicts t + 1 (the wrapped last one is dropped)
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    losses: dict[str, float] = {}
    for i in range(args.steps + 1):  # step 0 warms both up
        for name in ("ours", "hf"):
            model = ours if name == "ours" else hf
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            if name == "ours":
                loss = ours(tokens, labels=labels)[:, :-1].mean()
            else:
                loss = hf(input_ids=tokens, labels=tokens).loss  # HF shifts
            loss.backward()
            if i > 0:
                times[name].append(time.perf_counter() - t)
            losses[name] = float(loss.detach())
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "ratio": med["hf"] / med["ours"],
        "ours_step_s": med["ours"],
        "hf_step_s": med["hf"],
        "loss_diff": abs(losses["ours"] - losses["hf"]),
        "dtype": args.dtype,
        "shape": {
            k: getattr(args, k) for k in ("layers", "hidden", "experts", "topk", "ffn", "seq", "batch")
        },
        "host": f"cpu x{torch.get_num_threads()} threads",
    }
    print(
        f"ours {med['ours']:.3f} s/step | transformers Mixtral {med['hf']:.3f} s/step | ratio {result['ratio']:.2f}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
