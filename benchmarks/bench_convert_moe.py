"""Convert a Mixtral-shaped mixture-of-experts ``torch_dist`` checkpoint (saved by us at tp2 pp2)
to Hugging Face and measure the conversion's memory and speed.

A random 8-expert top-2 model (default about 1B parameters, bf16; ``--quick``: a tiny one for a
smoke test) is written with our ``torch_dist`` writer (streaming: each tensor generated when the
file writer reaches it), then ``mlm-convert to-hf --no-verify`` runs in a fresh process whose
peak RSS is measured (the verification is a separate, optional pass).

Reports ``to_hf_peak_rss_over_model`` (goal <= 1.0: the export streams, never holding the model)
and ``mb_per_s`` (model bytes per second of wall time). The last line is one JSON object.
Usage: ``python -m benchmarks.bench_convert_moe [--quick] [--workdir DIR]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:  # run as ``python benchmarks/<script>.py`` (benchmarks/ on sys.path) or as a module
    from common import save_synthetic_torch_dist
except ImportError:
    from benchmarks.common import save_synthetic_torch_dist

SIZES = {  # layers, hidden, heads, groups, expert ffn, vocab, experts
    "1b": (12, 1024, 16, 4, 2816, 32000, 8),
    "tiny": (2, 64, 4, 2, 96, 500, 8),
}
GOAL = 1.0


def _config(size: str):  # noqa: ANN202
    from pretrain.config import ModelConfig

    layers, hidden, heads, groups, ffn, vocab, experts = SIZES[size]
    return ModelConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=ffn, vocab_size=vocab, max_position_embeddings=4096, normalization="RMSNorm",
        swiglu=True, position_embedding_type="rope", untie_embeddings_and_output_weights=True,
        add_bias_linear=False, params_dtype="bfloat16", num_experts=experts, moe_router_topk=2,
    )  # fmt: skip


def _save(size: str, out: Path) -> int:
    return save_synthetic_torch_dist(_config(size), out)


def _child(ckpt: Path, save: Path) -> None:
    from tools.convert_cli import main

    start = time.perf_counter()
    assert main(["to-hf", "--load", str(ckpt), "--save", str(save), "--weights-only", "--no-verify"]) == 0
    wall = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"wall_s": round(wall, 3), "peak_rss_bytes": rss}))


def _measure(ckpt: Path, save: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "benchmarks.bench_convert_moe", "--child", str(ckpt), str(save)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"to-hf failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model (smoke test)")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        _child(Path(a.child[0]), Path(a.child[1]))
        return
    size = "tiny" if a.quick else "1b"
    work = Path(tempfile.mkdtemp(dir=a.workdir, prefix="bench_convert_moe."))
    try:
        t0 = time.perf_counter()
        model_bytes = _save(size, work / "ckpt")
        save_s = time.perf_counter() - t0
        to_hf = _measure(work / "ckpt", work / "hf")
        hf_files = sorted(f.name for f in (work / "hf").iterdir())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = to_hf["peak_rss_bytes"] / model_bytes
    print(json.dumps({
        "benchmark": "convert_moe_torch_dist_to_hf", "size": size, "params": model_bytes // 2,
        "experts": SIZES[size][6], "model_bytes": model_bytes, "save_torch_dist_s": round(save_s, 2),
        "to_hf_wall_s": to_hf["wall_s"], "to_hf_peak_rss_bytes": to_hf["peak_rss_bytes"],
        "to_hf_peak_rss_over_model": round(ratio, 3), "mb_per_s": round(model_bytes / 1e6 / to_hf["wall_s"], 1),
        "goal_rss_over_model": GOAL, "goal_met": ratio <= GOAL, "hf_files": hf_files,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
