"""Forward+backward time of our mixture-of-experts decoder against transformers' ``MixtralForCausalLM``.

Both get the same Mixtral shape and the same weights (HF's copied into ours: fused QKV in
Megatron's group order, each expert's ``[gate; up]`` and ``down``, the router), the same batch,
dropout off, SDPA attention and the same dtype. Steps alternate between the two so that machine
noise hits both alike; the median step times are compared. Also checks that the two losses agree.

    python benchmarks/bench_moe_step.py                  # 4 layers, h 512, 8 experts top-2, seq 512
    python benchmarks/bench_moe_step.py --quick          # tiny shapes (a smoke test)

Last line: ``{"ratio": HF step time / ours (>1: we are faster), "loss_diff": ..., ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(args: argparse.Namespace):
    """``(ours, hf)`` with identical weights."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from pretrain.config import ModelConfig
    from pretrain.models.families.llama import fuse_qkv
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
    cfg = ModelConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, num_query_groups=args.kv_heads,
        vocab_size=args.vocab, max_position_embeddings=args.seq, ffn_hidden_size=args.ffn, hidden_dropout=0.0,
        attention_dropout=0.0, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
        rotary_base=hf_cfg.rope_parameters["rope_theta"] if hasattr(hf_cfg, "rope_parameters") else 1e6,
        untie_embeddings_and_output_weights=True, add_bias_linear=False, num_experts=args.experts,
        moe_router_topk=args.topk, params_dtype=args.dtype,
    )  # fmt: skip
    sd, full, lm = hf.state_dict(), {}, "language_model."
    full[lm + "embedding.word_embeddings.weight"] = sd["model.embed_tokens.weight"]
    full[lm + "encoder.final_layernorm.weight"] = sd["model.norm.weight"]
    full[lm + "output_layer.weight"] = sd["lm_head.weight"]
    for i in range(args.layers):
        o, h = f"{lm}encoder.layers.{i}.", f"model.layers.{i}."
        q, k, v = (sd[f"{h}self_attn.{n}_proj.weight"] for n in "qkv")
        full[o + "self_attention.query_key_value.weight"] = fuse_qkv(q, k, v, groups=args.kv_heads,
                                                                     head_dim=args.hidden // args.heads)  # fmt: skip
        full[o + "self_attention.dense.weight"] = sd[h + "self_attn.o_proj.weight"]
        full[o + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"]
        full[o + "post_attention_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"]
        full[o + "mlp.router.weight"] = sd[h + "mlp.gate.weight"]
        for e in range(args.experts):
            full[f"{o}mlp.experts.{e}.dense_h_to_4h.weight"] = sd[h + "mlp.experts.gate_up_proj"][e]
            full[f"{o}mlp.experts.{e}.dense_4h_to_h.weight"] = sd[h + "mlp.experts.down_proj"][e]
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
