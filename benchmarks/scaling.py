"""Cost curves: how time and memory grow with the work, for the toolkit's main jobs.

Each curve runs one benchmark at several sizes and fits ``cost = a * work^slope`` on a log-log
scale (least squares); slope 1 means linear, below 1 means fixed costs still dominate:

* reshard, to-hf and from-hf: seconds and peak RSS vs model bytes (``bench_reshard.py --layers
  --hidden``: 25M, 124M and 355M parameters; ``--quick``: 25M, 51M, 124M);
* eval: seconds vs tokens of the WikiText paper method (a small GPT, :mod:`mlm_eval.tasks.wikitext`);
* dedup: seconds and peak RSS vs documents (``bench_dedup.py --docs``: 10k, 50k, 200k;
  ``--quick``: 10k, 20k, 40k);
* training: tokens/s vs micro-batch and vs sequence length (``bench_train.py``; a flat curve,
  slope ~0, means throughput does not depend on the shape).

    python benchmarks/scaling.py [--quick] [--out benchmarks/results]

Writes ``scaling.json`` (every point and slope), ``scaling.md`` (a table) and ``scaling.png`` (a
log-log panel per job) under ``--out``; the last line printed is the JSON summary of the slopes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # ``python benchmarks/scaling.py`` imports ``benchmarks.*``
Curve = dict[str, Any]  # {"job", "x", "y", "x_label", "y_label", "points": [[x, y], ...]}


def run_json(argv: list[str], timeout: float = 3600) -> dict[str, Any]:
    """Run a benchmark script as a child; its last stdout line as JSON."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:3])} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of log(y) on log(x)."""
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


def convert_curves(quick: bool) -> list[Curve]:
    shapes = [(4, 384), (8, 512), (12, 768)] if quick else [(4, 384), (12, 768), (24, 1024)]
    rows = []
    for layers, hidden in shapes:
        r = run_json(["-m", "benchmarks.bench_reshard", "--layers", str(layers), "--hidden", str(hidden)])
        phases = {p["phase"]: p for p in r["phases"]}  # reshard, to-hf, from-hf
        rows.append((r["model_bytes"], phases))
        print(f"  convert {r['model_bytes'] / 1e6:8.1f} MB: "
              + ", ".join(f"{job} {p['seconds']:.1f} s" for job, p in phases.items()), flush=True)  # fmt: skip
    mb = "model MB"
    return [
        {"job": job, "x_label": mb, "y_label": label, "points": [(b / 1e6, ph[job][key]) for b, ph in rows]}
        for job in rows[0][1]
        for label, key in (("seconds", "seconds"), ("peak RSS MB", "peak_rss_mb"))
    ]


def eval_curve(quick: bool) -> list[Curve]:
    import random

    import torch

    from benchmarks.bench_eval import build_tokenizer, wikitext_like
    from mlm_eval.scoring.megatron import MegatronGPTScorer
    from mlm_eval.tasks.wikitext import evaluate_wikitext_paper
    from pretrain.config import ModelConfig
    from pretrain.models.gpt import GPTModel
    from pretrain.models.init import init_model_parameters
    from pretrain.parallel.state import ParallelState

    tokenizer = build_tokenizer(wikitext_like(random.Random(1), 300))
    cfg = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=len(tokenizer),
                      max_position_embeddings=256, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    model = GPTModel(cfg, ParallelState.single())
    init_model_parameters(model, seed=0)
    scorer = MegatronGPTScorer(model, batch_size=8)
    points = []
    for lines in (25, 50, 100) if quick else (100, 300, 900):
        text = wikitext_like(random.Random(0), lines)
        started = time.perf_counter()
        with torch.inference_mode():
            m = evaluate_wikitext_paper(scorer, tokenizer, text, seq_length=256, overlap=32, progress=False)
        points.append((float(m["num_tokens"]), time.perf_counter() - started))
        print(f"  eval {points[-1][0]:8.0f} tokens: {points[-1][1]:.2f} s", flush=True)
    return [
        {"job": "eval (WikiText paper method)", "x_label": "tokens", "y_label": "seconds", "points": points}
    ]


def dedup_curves(quick: bool) -> list[Curve]:
    rows = []
    for docs in (10_000, 20_000, 40_000) if quick else (10_000, 50_000, 200_000):
        r = run_json(
            ["benchmarks/bench_dedup.py", "--docs", str(docs), "--no-baselines", "--eval-examples", "200"]
        )
        rss = max(r["dedup_parent_peak_rss_mb"], r["dedup_worker_peak_rss_mb"])
        rows.append((docs, r["dedup_seconds"], rss))
        print(f"  dedup {docs:8d} docs: {r['dedup_seconds']:.1f} s, {rss:.0f} MB", flush=True)
    return [
        {
            "job": "dedup",
            "x_label": "documents",
            "y_label": "seconds",
            "points": [(d, s) for d, s, _ in rows],
        },
        {
            "job": "dedup",
            "x_label": "documents",
            "y_label": "peak RSS MB",
            "points": [(d, m) for d, _, m in rows],
        },
    ]


def train_curves(quick: bool) -> list[Curve]:
    base = ["benchmarks/bench_train.py", "--layers", "2", "--hidden", "128", "--heads", "4",
            "--iters", "3" if quick else "8", "--warmup", "1"]  # fmt: skip
    by_micro, by_seq = [], []
    for micro in (1, 2, 4, 8):
        r = run_json([*base, "--seq", "128", "--batch", "8", "--micro-batch", str(micro)])
        by_micro.append((micro, r["ours_tokens_per_s"]))
        print(f"  train micro-batch {micro}: {r['ours_tokens_per_s']:.0f} tokens/s", flush=True)
    for seq in (64, 128, 256) if quick else (128, 256, 512, 1024):
        r = run_json([*base, "--seq", str(seq), "--batch", "4"])
        by_seq.append((seq, r["ours_tokens_per_s"]))
        print(f"  train seq {seq}: {r['ours_tokens_per_s']:.0f} tokens/s", flush=True)
    return [
        {"job": "training", "x_label": "micro-batch", "y_label": "tokens/s", "points": by_micro},
        {"job": "training", "x_label": "sequence length", "y_label": "tokens/s", "points": by_seq},
    ]


def write_outputs(curves: list[Curve], out: Path, quick: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for c in curves:
        c["slope"] = round(slope(c["points"]), 3)
    (out / "scaling.json").write_text(json.dumps({"quick": quick, "curves": curves}, indent=1) + "\n")
    lines = ["| job | cost | vs | points (work: cost) | log-log slope |", "|---|---|---|---|---|"]
    for c in curves:
        pts = ", ".join(f"{x:g}: {y:.3g}" for x, y in c["points"])
        lines.append(f"| {c['job']} | {c['y_label']} | {c['x_label']} | {pts} | {c['slope']:.2f} |")
    (out / "scaling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    cols = 3
    fig, axes = plt.subplots(
        math.ceil(len(curves) / cols), cols, figsize=(13, 3.4 * math.ceil(len(curves) / cols))
    )
    for ax, c in zip(axes.flat, curves):
        xs, ys = zip(*c["points"])
        ax.loglog(xs, ys, "o-")
        ax.set_title(f"{c['job']}: slope {c['slope']:.2f}", fontsize=10)
        ax.set_xlabel(c["x_label"])
        ax.set_ylabel(c["y_label"])
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(curves) :]:
        ax.axis("off")
    fig.suptitle("mlm-toolkit cost curves" + (" (--quick)" if quick else ""))
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes (minutes on a 2-core machine)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--only", choices=["convert", "eval", "dedup", "train"], action="append",
                   help="run only these curves (repeatable)")  # fmt: skip
    args = p.parse_args()
    jobs = {"convert": convert_curves, "eval": eval_curve, "dedup": dedup_curves, "train": train_curves}
    curves: list[Curve] = []
    for name, fn in jobs.items():
        if args.only and name not in args.only:
            continue
        print(f"{name}:", flush=True)
        curves += fn(args.quick)
    write_outputs(curves, args.out, args.quick)
    print(json.dumps({f"{c['job']} {c['y_label']} vs {c['x_label']}": c["slope"] for c in curves}))


if __name__ == "__main__":
    main()
