"""LAMBADA small-batch overhead: mlm-eval's scoring vs an HF loop computing only the targets' log-probs.

One randomly initialised GPT-2-shaped model of about 5M parameters (6 layers, hidden 256,
a 2000-token byte-level BPE trained on the passages) scores ``--passages`` short generated
passages (context + last word), ``--batch-size`` passages per forward, in fp32:

* ours: :func:`mlm_eval.tasks.lambada.evaluate_lambada` (strict last-word split, rows padded on the
  right, :class:`MegatronGPTScorer`: output layer only at target positions, float64 log-softmax);
* reference: the same rows, batched the same way, through ``GPT2LMHeadModel``; the logits at the
  target positions only go through ``log_softmax`` and the argmax check (the cheapest honest HF loop).

Both get the same token rows (tokenization outside the timed region); ours is also timed end to
end (``evaluate_lambada``, its own tokenization included) as ``ours_with_tokenize_s``.

    python benchmarks/bench_lambada.py [--passages 200] [--batch-size 8]

Last line: one JSON object with ``ratio`` (ours seconds / reference seconds: overhead factor, the
goal is <= 1.2), ``accuracy_equal`` and ``max_abs_nll_diff``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from typing import Any

import torch

try:  # run as ``python benchmarks/<script>.py`` (benchmarks/ on sys.path) or as a module
    from bench_eval import WORDS, build_tokenizer
except ImportError:
    from benchmarks.bench_eval import WORDS, build_tokenizer
from mlm_eval.scoring.megatron import MegatronGPTScorer, eval_model_config
from mlm_eval.scoring.scorer import IGNORE, as_text_encoder, score_rows
from mlm_eval.tasks.lambada import evaluate_lambada, split_example
from pretrain.models.families.gpt2 import hf_to_canonical, model_config_from_hf
from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import load_full_state_dict
from pretrain.parallel.state import ParallelState

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def passages(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(25, 60))) for _ in range(n)]


@torch.inference_mode()
def reference(
    model: Any, rows: list[tuple[list[int], list[int]]], batch_size: int
) -> list[tuple[float, bool]]:
    """HF loop: right-padded batches, log-softmax and argmax only at the target positions."""
    out = []
    for lo in range(0, len(rows), batch_size):
        batch = rows[lo : lo + batch_size]
        width = max(len(c) + len(t) - 1 for c, t in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (c, t) in enumerate(batch):
            seq = (c + t)[:-1]
            ids[i, : len(seq)] = torch.tensor(seq)
        logits = model(input_ids=ids).logits
        for i, (c, t) in enumerate(batch):
            pos = torch.arange(len(c) - 1, len(c) + len(t) - 1)
            logp = torch.log_softmax(logits[i, pos].double(), dim=-1)
            target = torch.tensor(t)
            nll = -float(logp.gather(1, target[:, None]).sum())
            out.append((nll, bool((logp.argmax(-1) == target).all())))
    return out


def best_of(fn: Any, repeats: int) -> tuple[Any, float]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return result, statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passages", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="median of this many timed runs each")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    texts = passages(args.passages, args.seed)
    tokenizer = build_tokenizer("\n".join(passages(300, args.seed + 1)))
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=256, n_embd=256, n_layer=6, n_head=8,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    hf = GPT2LMHeadModel(config).eval()
    cfg = eval_model_config(model_config_from_hf(hf.config), "float32")
    model = GPTModel(cfg, ParallelState.single())
    load_full_state_dict(model, hf_to_canonical(hf.state_dict(), cfg))
    scorer = MegatronGPTScorer(model, batch_size=args.batch_size)
    encoder = as_text_encoder(tokenizer)
    rows = [split_example(encoder, t, strict=True) for t in texts]
    ref, ref_s = best_of(lambda: reference(hf, rows, args.batch_size), args.repeats)
    scorer_rows = [((c + t)[:-1], [IGNORE] * (len(c) - 1) + t) for c, t in rows]
    ours, ours_s = best_of(
        lambda: score_rows(scorer, scorer_rows, batch_size=args.batch_size, progress=False), args.repeats
    )
    _, e2e_s = best_of(
        lambda: evaluate_lambada(scorer, tokenizer, texts, batch_size=args.batch_size, progress=False), 1
    )
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.passages} passages, {params / 1e6:.1f}M parameters, batch {args.batch_size}")
    print(f"reference (HF, target log-probs only): {ref_s:.2f} s")
    print(f"mlm-eval scorer (same rows):          {ours_s:.2f} s  ({ours_s / ref_s:.2f}x the reference)")
    print(json.dumps({
        "ratio": round(ours_s / ref_s, 3), "ours_s": round(ours_s, 3), "reference_s": round(ref_s, 3),
        "ours_with_tokenize_s": round(e2e_s, 3),
        "accuracy_equal": [all(s.is_argmax) for s in ours] == [c for _, c in ref],
        "max_abs_nll_diff": max(abs(math.fsum(s.nll) - n) for s, (n, _) in zip(ours, ref)),
        "passages": args.passages, "batch_size": args.batch_size, "parameters": params,
        "threads": torch.get_num_threads(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
