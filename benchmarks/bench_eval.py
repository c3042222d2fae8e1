"""mlm-eval's WikiText paper method vs a plain Hugging Face loop: same perplexity, how much faster.

On one randomly initialised GPT-2-small-shaped model (12 layers, hidden 768, 12 heads, vocab
50257) and one generated WikiText-format text (a byte-level BPE trained on it tokenizes it):

* reference: ``GPT2LMHeadModel`` run on one window at a time, full logits ``[s, V]`` and a full
  log-softmax per window, the upstream Megatron-LM loop (windows every ``overlap`` tokens, the
  first scoring all its targets, later ones their last ``overlap``), in fp32 and in bf16;
* ours: :func:`mlm_eval.tasks.wikitext.evaluate_wikitext_paper` with :class:`MegatronGPTScorer` on the
  same weights (``hf_to_canonical``): batched windows, the last layer's queries, attention,
  projection and MLP and the output layer only at scored positions, fp32 and ``--dtype bf16``.

Each dtype is compared with the reference in the *same* dtype (bf16 matrix multiplication is no
faster than fp32 on some CPUs, much faster on others). ``peak_fraction_<dtype>``: the model FLOPs
ours needs (per window ``2 * 12 L h^2 s + 2 L s^2 h`` for the trunk, plus ``2 h V`` per scored
token) over its time, as a fraction of this machine's ``<dtype>`` GEMM peak.

    python benchmarks/bench_eval.py [--quick] [--tokens 1700] [--seq-length 1024] [--overlap 32]

Last line: one JSON object with ``ratio`` (reference fp32 seconds / ours fp32),
``ratio_bf16_same_dtype`` (reference bf16 / ours bf16), ``rel_diff`` (fp32 adjusted perplexities),
``rel_diff_bf16`` (bf16 vs bf16), ``peak_fraction_fp32`` and ``peak_fraction_bf16``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from typing import Any

import torch

try:  # run as ``python benchmarks/<script>.py`` (benchmarks/ on sys.path) or as a module
    from common import matmul_peak_flops
except ImportError:
    from benchmarks.common import matmul_peak_flops
from mlm_eval.scoring.megatron import MegatronGPTScorer, eval_model_config
from mlm_eval.tasks.detokenize import count_original_tokens, wikitext_detokenize
from mlm_eval.tasks.wikitext import evaluate_wikitext_paper
from pretrain.models.families.gpt2 import hf_to_canonical, model_config_from_hf
from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import load_full_state_dict
from pretrain.parallel.state import ParallelState

os.environ.setdefault("HF_HUB_OFFLINE", "1")
WORDS = [
    "harbor", "lamp", "society", "coast", "winter", "storm", "member", "village", "river", "bridge", "tower",
    "market", "school", "ferry", "pilot", "signal", "museum", "garden", "station", "road", "valley", "island",
    "north", "south", "record", "album", "season", "player", "match", "league", "city", "council", "church",
]  # fmt: skip


def wikitext_like(rng: random.Random, lines: int) -> str:
    """WikiText-format raw text: headings, ``@-@``/``@,@`` numbers, spaced punctuation."""
    out = [" \n"]
    for i in range(lines):
        if i % 6 == 0:
            out += [f" {'= ' * (1 + i % 2)}{rng.choice(WORDS).title()} {'= ' * (1 + i % 2)}\n", " \n"]
        words = []
        for _ in range(rng.randint(20, 60)):
            r = rng.random()
            token = (f"{rng.randint(1, 99)} @,@ {rng.randint(100, 999)}" if r < 0.05
                     else f"{rng.choice(WORDS)} @-@ {rng.choice(WORDS)}" if r < 0.1
                     else rng.choice([",", ".", "(", ")"]) if r < 0.2 else rng.choice(WORDS))  # fmt: skip
            words.append(token)
        out.append(" " + " ".join(words) + " . \n")
    return "".join(out)


def build_tokenizer(text: str) -> Any:
    """A byte-level BPE (2000 tokens) trained on ``text``, as a transformers fast tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        text.splitlines(), vocab_size=2000, min_frequency=2, special_tokens=["<|endoftext|>"]
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")


def text_of(tokens: int, tokenizer: Any, seed: int) -> str:
    """Generated raw text whose detokenized form has at least ``tokens`` tokens."""
    lines = 8
    while True:
        text = wikitext_like(random.Random(seed), lines)
        if len(tokenizer.encode(wikitext_detokenize(text))) >= tokens:
            return text
        lines += 4


@torch.inference_mode()
def reference_ppl(model: Any, tokens: list[int], seq_length: int, overlap: int, num_original: int) -> float:
    """The plain loop: one window per forward, full logits and log-softmax, upstream windows."""
    total, start, scored_to = 0.0, 0, 1  # scored_to: first target position not yet scored
    while scored_to < len(tokens):
        window = tokens[start : start + seq_length + 1]
        logits = model(torch.tensor([window[:-1]])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(window[1:])
        nll = -logp.gather(1, targets[:, None])[:, 0]
        first = scored_to - (start + 1)  # positions before it were scored by earlier windows
        total += float(nll[first:].double().sum())
        scored_to = start + len(window)
        start += overlap
    return math.exp(total / (num_original - 1))


def our_scorer(hf: Any, dtype: str, batch_size: int) -> MegatronGPTScorer:
    """Our GPT with the HF model's weights (canonical tensors), parameters in ``dtype``."""
    cfg = eval_model_config(model_config_from_hf(hf.config), dtype)
    model = GPTModel(cfg, ParallelState.single())
    load_full_state_dict(model, hf_to_canonical(hf.state_dict(), cfg))
    return MegatronGPTScorer(model, batch_size=batch_size)


def our_ppl(scorer: MegatronGPTScorer, tokenizer: Any, text: str, args: argparse.Namespace) -> float:
    metrics = evaluate_wikitext_paper(scorer, tokenizer, text, seq_length=args.seq_length, overlap=args.overlap,
                                      batch_size=args.batch_size, progress=False)  # fmt: skip
    return float(metrics["adjusted_ppl"])


def model_flops(config: Any, windows: int, seq: int, scored: int) -> float:
    """Forward FLOPs ours must do: the trunk on every window (GEMMs + causal attention) and the
    output layer at the ``scored`` targets."""
    layers, h = config.n_layer, config.n_embd
    trunk = 2 * 12 * layers * h * h * seq + 2 * layers * seq * seq * h
    return float(windows * trunk + scored * 2 * h * config.vocab_size)


def timed(fn: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq 256, ~600 tokens (seconds, not minutes)")
    parser.add_argument("--tokens", type=int, default=1700, help="text length in tokens (default 1700)")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--overlap", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4, help="windows per forward, ours (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-bf16", action="store_true", help="fp32 only")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.seq_length = 600, 256
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = build_tokenizer(wikitext_like(random.Random(args.seed + 1), 300))
    text = text_of(args.tokens, tokenizer, args.seed)
    tokens = tokenizer.encode(wikitext_detokenize(text))
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    hf = GPT2LMHeadModel(config).eval()
    windows = 1 + -(-max(len(tokens) - 1 - args.seq_length, 0) // args.overlap)
    print(f"text: {len(tokens)} tokens, {windows} windows of {args.seq_length} (overlap {args.overlap}), "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    num_original = count_original_tokens(text)
    run: dict[str, dict[str, float]] = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        if name == "bf16" and args.no_bf16:
            continue
        ref_model = hf.to(dtype)
        ref, ref_s = timed(
            lambda m=ref_model: reference_ppl(m, tokens, args.seq_length, args.overlap, num_original)
        )
        print(f"reference (HF, full logits, {name}): adjusted ppl {ref:.6f}  {ref_s:.1f} s")
        scorer = our_scorer(hf, {"fp32": "float32", "bf16": "bfloat16"}[name], args.batch_size)
        ours, ours_s = timed(lambda sc=scorer: our_ppl(sc, tokenizer, text, args))
        print(f"mlm-eval {name}:                      adjusted ppl {ours:.6f}  {ours_s:.1f} s  "
              f"({ref_s / ours_s:.2f}x)")  # fmt: skip
        peak = matmul_peak_flops(dtype=dtype)
        run[name] = {"ref": ref, "ref_s": ref_s, "ours": ours, "ours_s": ours_s, "peak": peak}
    flops = model_flops(config, windows, args.seq_length, len(tokens) - 1)
    result: dict[str, Any] = {
        "ratio": round(run["fp32"]["ref_s"] / run["fp32"]["ours_s"], 3),
        "rel_diff": abs(run["fp32"]["ours"] - run["fp32"]["ref"]) / run["fp32"]["ref"],
        "peak_fraction_fp32": round(flops / run["fp32"]["ours_s"] / run["fp32"]["peak"], 3),
    }
    if "bf16" in run:
        b = run["bf16"]
        result.update(ratio_bf16_same_dtype=round(b["ref_s"] / b["ours_s"], 3),
                      rel_diff_bf16=abs(b["ours"] - b["ref"]) / b["ref"],
                      peak_fraction_bf16=round(flops / b["ours_s"] / b["peak"], 3),
                      reference_bf16_s=round(b["ref_s"], 2), ours_bf16_s=round(b["ours_s"], 2),
                      matmul_peak_bf16_gflops=round(b["peak"] / 1e9, 1))  # fmt: skip
    result.update({
        "reference_s": round(run["fp32"]["ref_s"], 2),
        "ours_s": round(run["fp32"]["ours_s"], 2),
        "matmul_peak_fp32_gflops": round(run["fp32"]["peak"] / 1e9, 1),
        "tokens": len(tokens),
        "windows": windows,
        "seq_length": args.seq_length,
        "overlap": args.overlap,
        "threads": torch.get_num_threads(),
    })  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
