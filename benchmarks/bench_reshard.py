"""Reshard and HF-export throughput and peak memory for a GPT of the paper's 355M shape.

A GPT (24 layers, hidden 1024, 16 heads, vocab 50257, 1024 positions, fp32) of random weights is
written at tp=2, pp=2 with :func:`pretrain.checkpoint.legacy.writer.write_layout` from a source that
generates each canonical tensor on demand (deterministically, so repeated reads agree) and never
holds the model. Then, each in its own subprocess, ``mlm-convert reshard`` to tp=4, pp=1,
``mlm-convert to-hf`` of the result and ``mlm-convert from-hf`` of that export back to tp=2, pp=2
run while this process (stdlib only, so a forked child starts small) waits for them with
``os.wait4``, which returns that child's ``getrusage`` (``ru_maxrss``: peak resident set,
file-backed pages of the mmap'd source included).

Reported per phase: wall seconds, MB/s (model bytes / seconds) and peak RSS over the model's
bytes. Target: the reshard's, the to-hf export's and the from-hf import's peak RSS <= 1.5x the
model bytes (to-hf streams sharded safetensors, ``--max-shard-size``; from-hf builds each tensor
from the memory-mapped export while writing the rank file that holds it). The last line is one
JSON object with ``peak_rss_over_model`` and ``seconds`` (both for the reshard),
``to_hf_peak_rss_over_model``, ``from_hf_peak_rss_over_model`` and every phase's numbers.
``--layers/--hidden`` pick other sizes (``benchmarks/scaling.py``).
Needs about 4x the model (~5.7 GB) of free disk under ``--workdir``; everything is deleted at the
end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPE: dict[str, Any] = {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "vocab_size": 50257,
         "max_position_embeddings": 1024}  # fmt: skip
TARGET_RATIO = 1.5


class RandomSource:
    """Canonical GPT tensors of ``cfg`` generated on demand (``N(0, 0.02)``, seeded per tensor)."""

    def __init__(self, cfg: Any) -> None:
        import torch

        from pretrain.checkpoint.plan import ModelSpec
        from pretrain.models.gpt import GPTModel
        from pretrain.parallel.state import ParallelState

        self.spec = ModelSpec(kind="gpt", cfg=cfg)
        meta = GPTModel(cfg, ParallelState.single(device="meta"))
        self.shapes = {meta.canonical_name(n): tuple(p.shape) for n, p in meta.named_parameters()}
        self.shapes["language_model.embedding.word_embeddings.weight"] = (cfg.vocab_size, cfg.hidden_size)
        self.torch = torch

    def names(self) -> list[str]:
        return list(self.shapes)

    def tensor(self, name: str) -> Any:
        gen = self.torch.Generator().manual_seed(self.names().index(name))
        return self.torch.randn(self.shapes[name], generator=gen) * 0.02

    def stored_rows(self, name: str) -> Any:  # no padding rows stored
        return self.tensor(name)

    def nbytes(self) -> int:
        return sum(4 * int(self.torch.Size(s).numel()) for s in self.shapes.values())


def write_source(save: str, shape: dict[str, Any]) -> None:
    """Child phase: write the random model at tp=2, pp=2; print its bytes."""
    from pretrain.checkpoint.legacy.writer import WriteOptions, write_layout
    from pretrain.config import ModelConfig
    from pretrain.parallel.config import ParallelConfig

    source = RandomSource(ModelConfig(**shape, hidden_dropout=0.0, attention_dropout=0.0))
    write_layout(source, save, ParallelConfig(tp=2, pp=2), options=WriteOptions(iteration=1))
    print(source.nbytes())


def _run_measured(argv: list[str]) -> dict[str, float]:
    """Run ``argv`` as a child; its wall seconds and peak RSS (bytes) from ``os.wait4``."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    out = proc.stdout.read() if proc.stdout else ""
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} failed ({proc.returncode}):\n{err[-3000:]}")
    return {"seconds": seconds, "peak_rss": usage.ru_maxrss * 1024.0, "stdout": out}  # type: ignore[dict-item]


def _phase(name: str, argv: list[str], model_bytes: float) -> dict[str, Any]:
    m = _run_measured(argv)
    row = {
        "phase": name,
        "seconds": round(m["seconds"], 2),
        "mb_per_s": round(model_bytes / 1e6 / m["seconds"], 1),
        "peak_rss_mb": round(m["peak_rss"] / 1e6, 1),
        "peak_rss_over_model": round(m["peak_rss"] / model_bytes, 3),
    }
    print(f"{name:8s} {row['seconds']:8.2f} s {row['mb_per_s']:8.1f} MB/s  peak RSS {row['peak_rss_mb']:8.1f} MB "
          f"= {row['peak_rss_over_model']:.2f}x model", flush=True)  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workdir", type=Path, default=None, help="scratch directory (default: a new /tmp dir)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--layers", type=int, default=SHAPE["num_layers"], help="default 24 (355M)")
    parser.add_argument("--hidden", type=int, default=SHAPE["hidden_size"], help="default 1024 (355M)")
    parser.add_argument("--max-shard-size", default="5GB", help="to-hf shard size (default 5GB)")
    parser.add_argument("--write-source", metavar="DIR", help=argparse.SUPPRESS)  # child phase
    args = parser.parse_args(argv)
    # 16 heads whenever the width allows (the parameter count does not depend on it): the target
    # layout splits heads 4 ways, which hidden // 64 heads (6 at width 384) would not allow.
    heads = 16 if args.hidden % 16 == 0 else max(1, args.hidden // 64)
    shape = {**SHAPE, "num_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": heads}
    if args.write_source:
        write_source(args.write_source, shape)
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench_reshard_", dir=args.workdir))
    free = shutil.disk_usage(work).free
    if free < 6e9:
        shutil.rmtree(work)
        raise SystemExit(f"{work}: {free / 1e9:.1f} GB free, need ~6 GB")
    py, cli = sys.executable, [sys.executable, "-m", "tools.convert_cli"]
    try:
        t0 = time.perf_counter()
        made = _run_measured([py, "-m", "benchmarks.bench_reshard", "--write-source", str(work / "src"),
                              "--layers", str(args.layers), "--hidden", str(args.hidden)])  # fmt: skip
        model_bytes = float(made["stdout"].strip().splitlines()[-1])  # type: ignore[attr-defined]
        print(f"model: {model_bytes / 1e6:.1f} MB fp32; source written at tp=2, pp=2 in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
        reshard = _phase("reshard", [*cli, "reshard", "--load", str(work / "src"), "--save", str(work / "tp4"),
                                     "--target-tp", "4", "--target-pp", "1"], model_bytes)  # fmt: skip
        to_hf = _phase("to-hf", [*cli, "to-hf", "--load", str(work / "tp4"), "--save", str(work / "hf"),
                                 "--max-shard-size", args.max_shard_size, "--weights-only"], model_bytes)  # fmt: skip
        from_hf = _phase("from-hf", [*cli, "from-hf", "--load", str(work / "hf"), "--save", str(work / "back"),
                                     "--tp", "2", "--pp", "2", "--weights-only"], model_bytes)  # fmt: skip
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result = {
        "model_bytes": int(model_bytes),
        "seconds": reshard["seconds"],
        "mb_per_s": reshard["mb_per_s"],
        "peak_rss_over_model": reshard["peak_rss_over_model"],
        "target_peak_rss_over_model": TARGET_RATIO,
        "meets_target": reshard["peak_rss_over_model"] <= TARGET_RATIO,
        "to_hf_peak_rss_over_model": to_hf["peak_rss_over_model"],
        "to_hf_seconds": to_hf["seconds"],
        "to_hf_meets_target": to_hf["peak_rss_over_model"] <= TARGET_RATIO,
        "from_hf_peak_rss_over_model": from_hf["peak_rss_over_model"],
        "from_hf_seconds": from_hf["seconds"],
        "from_hf_meets_target": from_hf["peak_rss_over_model"] <= TARGET_RATIO,
        "layers": args.layers,
        "hidden": args.hidden,
        "phases": [reshard, to_hf, from_hf],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
