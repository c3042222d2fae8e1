"""lm-evaluation-harness wall time through ``--model mlm`` vs ``--model hf``, and KV-cache decoding speed.

One GPT (random init plus one training step; ``--layers/--hidden/--seq`` shape) is saved as our
checkpoint and exported with ``mlm-convert to-hf``. Both harness backends then run the same four
local tasks (lambada-style loglikelihood, wikitext-style rolling, multiple choice, generate_until;
``tests/harness_fixtures.py``) with the same batch size, offline, fp32, in this one process.
Then our decoder generates ``--new-tokens`` tokens for 8 prompts with and without the KV cache.

    python benchmarks/bench_harness.py [--quick] [--docs 24] [--batch-size 8]

Last line: one JSON object with ``mlm_s``, ``hf_s``, ``ratio`` (hf seconds / mlm seconds; >= 1
means ours is at least as fast), ``max_rel_diff`` (over every aggregate metric), and
``cached_tok_s``, ``uncached_tok_s``, ``cache_speedup``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _build(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    from pretrain.training.cli import main as pretrain_main
    from tests.harness_fixtures import export_hf, write_tasks
    from tests.train_fixtures import gpt_args, make_gpt_data

    data = make_gpt_data(root)
    ckpt = root / "ckpt"
    flags = {"train-iters": 1, "save": ckpt, "num-layers": args.layers, "hidden-size": args.hidden,
             "num-attention-heads": args.hidden // 64 or 1, "seq-length": args.seq, "micro-batch-size": 1,
             "global-batch-size": 1}  # fmt: skip
    assert pretrain_main(gpt_args(data, **flags)) == 0
    hf = export_hf(str(ckpt), str(Path(data["vocab"]).parent), root / "hf")
    return {"data": data, "ckpt": ckpt, "hf": hf, "tasks": write_tasks(root, docs=args.docs)}


def _harness(model: str, model_args: str, tasks: Path, batch_size: int) -> tuple[float, dict[str, Any]]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import mlm_eval.harness.backend  # noqa: F401
    from tests.harness_fixtures import TASK_NAMES

    manager = TaskManager(include_path=str(tasks))
    start = time.perf_counter()
    out = simple_evaluate(model=model, model_args=model_args, tasks=list(TASK_NAMES), task_manager=manager,
                          device="cpu", batch_size=batch_size, verbosity="ERROR")  # fmt: skip
    return time.perf_counter() - start, out["results"]


def _decode_speed(ckpt: Path, data: dict[str, str], new_tokens: int) -> dict[str, float]:
    from mlm_eval.harness.engine import EngineConfig, HarnessEngine
    from pretrain.inference.generate import GenerationConfig, generate
    from pretrain.tokenizer.factory import TokenizerConfig

    tok = TokenizerConfig(
        tokenizer_type="GPT2BPETokenizer", vocab_file=data["vocab"], merge_file=data["merges"]
    )
    engine = HarnessEngine.load(EngineConfig(ckpt=str(ckpt), tokenizer=tok, progress=False))
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "the",
        "lazy",
        "dog",
        "and",
        "runs",
        "far",
        "away",
    ]
    prompts = [engine.tokenizer.tokenize(" ".join(words[: 3 + i])) for i in range(8)]
    out: dict[str, float] = {}
    tokens: dict[bool, list[list[int]]] = {}
    for cache in (True, False):
        cfg = GenerationConfig(max_new_tokens=new_tokens, use_cache=cache)
        start = time.perf_counter()
        tokens[cache] = generate(engine.model, prompts, cfg)
        out["cached_tok_s" if cache else "uncached_tok_s"] = (
            len(prompts) * new_tokens / (time.perf_counter() - start)
        )
    out["cache_speedup"] = out["cached_tok_s"] / out["uncached_tok_s"]
    out["cached_equals_uncached"] = float(tokens[True] == tokens[False])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model and few documents")
    p.add_argument("--docs", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=96)
    args = p.parse_args()
    if args.quick:
        args.docs, args.layers, args.hidden, args.seq, args.new_tokens = 8, 2, 128, 64, 32
    with tempfile.TemporaryDirectory() as tmp:
        built = _build(Path(tmp), args)
        data = built["data"]
        tok = f"tokenizer_type=GPT2BPETokenizer,vocab_file={data['vocab']},merge_file={data['merges']}"
        hf_s, hf = _harness("hf", f"pretrained={built['hf']},dtype=float32", built["tasks"], args.batch_size)
        mlm_s, mlm = _harness("mlm", f"ckpt={built['ckpt']},{tok}", built["tasks"], args.batch_size)
        diffs = [abs(mlm[t][k] - v) / max(abs(v), 1e-30) for t, row in hf.items() for k, v in row.items()
                 if isinstance(v, float) and "stderr" not in k]  # fmt: skip
        decode = _decode_speed(built["ckpt"], data, args.new_tokens)
    result = {"mlm_s": round(mlm_s, 2), "hf_s": round(hf_s, 2), "ratio": round(hf_s / mlm_s, 3),
              "max_rel_diff": max(diffs), "batch_size": args.batch_size, "docs": args.docs,
              "model": f"{args.layers}x{args.hidden} seq {args.seq}",
              **{k: round(v, 2) for k, v in decode.items()}}  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
