"""Conversion at disk speed in flat memory: the curve over model size (issue 29, part 1).

Per size, a synthetic Llama-shape bf16 model (GQA, SwiGLU, untied output) is written as a legacy
checkpoint at tp2 pp2 and as ``torch_dist``; then each conversion runs as its own ``python -m
tools.convert_cli`` process, timed as a user runs it, and once more with its whole process tree's
RssAnon sampled (:mod:`benchmarks.anon_memory`; the sampling slows it, so that run is not timed):

* ``to_hf``: legacy tp2 pp2 -> Hugging Face (``--max-shard-size 2GB``, ``--no-verify``);
* ``reshard``: legacy tp2 pp2 -> tp4 pp1;
* ``from_hf``: that HF export -> legacy tp2 pp2;
* ``to_torch_dist``: legacy tp2 pp2 -> ``torch_dist`` (reshard ``--ckpt-format torch_dist``);
* ``torch_dist_to_hf``: the generated ``torch_dist`` -> HF.

Each reports ``mb_per_s`` (source bytes / wall time, start-up included), ``time_over_cp``
(wall time / the time ``cp -r`` of the same source takes on the same disk, timed just before
this conversion: the paired ``cp_s``), ``cpu_s`` (user + system seconds of its processes: comparable on a loaded host) and
``peak_anon_gb``; per size ``largest_tensor_gb`` and the bound 2 x largest + 0.5 GB.
``anon_slope_gb_per_b_params`` is the least-squares slope of peak anonymous memory against
parameters (billions), per conversion (goal about 0). The last line is one JSON object.

With ``--nproc N`` (N > 1) every conversion runs as ``torchrun --nproc-per-node N`` (the output
files split among the processes); ``peak_anon_gb`` is then the sum over the launcher and its N
processes.

Usage: ``python -m benchmarks.bench_convert_scale [--quick | --large] [--sizes 0.5b,1b] [--workdir DIR]
[--nproc N] [--repeats N] [--plot docs/convert_scale.svg]``. ``--repeats N`` times each conversion N
times, each right after its own ``cp -r``, and reports medians (the ratio's too) and each ratio. Disk: about 4 copies of the largest model at once (3B: 24 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.anon_memory import run_measured

SIZES = {  # layers, hidden, heads, groups, ffn, vocab
    "tiny": (2, 256, 8, 2, 704, 4000),
    "small": (4, 512, 8, 2, 1408, 8000),
    "0.5b": (16, 1536, 16, 4, 4096, 32000),
    "1b": (20, 2048, 16, 4, 5632, 32000),
    "3b": (28, 3072, 24, 8, 8192, 32000),
    "7b": (32, 4096, 32, 8, 11008, 32000),
}
QUICK, DEFAULT, LARGE = ("tiny", "small"), ("0.5b", "1b", "3b"), ("0.5b", "1b", "3b", "7b")
GB = 1e9
CONVERSIONS = ("to_hf", "reshard", "from_hf", "to_torch_dist", "torch_dist_to_hf")


def model_config(size: str):  # noqa: ANN201
    from pretrain.config import ModelConfig

    layers, hidden, heads, groups, ffn, vocab = SIZES[size]
    return ModelConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=groups, ffn_hidden_size=ffn, vocab_size=vocab, max_position_embeddings=4096,
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, add_bias_linear=False, params_dtype="bfloat16",
    )  # fmt: skip


def canonical_shapes(size: str) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor's full shape (true vocabulary rows)."""
    from pretrain.checkpoint.plan import ModelSpec, chunk_slots

    cfg = model_config(size)
    slots = chunk_slots(ModelSpec(kind="gpt", cfg=cfg), tp=1, pre_process=True, post_process=True,
                        layer_numbers=range(cfg.num_layers))  # fmt: skip
    return {s.canonical: ((cfg.vocab_size, *s.shape[1:]) if s.vocab else tuple(s.shape)) for s in slots}


def random_source(size: str):  # noqa: ANN201
    """Canonical bf16 tensors made on demand from one random block (cheap: no randn per element)."""
    from pretrain.checkpoint.plan import ModelSpec
    from pretrain.checkpoint.types import LazySource

    block = (0.02 * torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)

    def maker(shape: tuple[int, ...], seed: int):  # noqa: ANN202
        def make() -> torch.Tensor:
            n = torch.Size(shape).numel()
            reps = -(-(n + seed) // block.numel())
            return block.repeat(reps)[seed : seed + n].view(shape).clone()

        return make

    shapes = canonical_shapes(size)
    makers = {n: maker(s, (i * 7919) % block.numel()) for i, (n, s) in enumerate(shapes.items())}
    return LazySource(ModelSpec(kind="gpt", cfg=model_config(size)), makers)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _generate(size: str, work: Path) -> tuple[Path, Path]:
    from pretrain.checkpoint.legacy.writer import WriteOptions, write_layout
    from pretrain.checkpoint.torch_dist.writer import write_torch_dist
    from pretrain.parallel.config import ParallelConfig

    src = random_source(size)
    legacy, dist = work / "legacy", work / "torch_dist"
    write_layout(src, legacy, ParallelConfig(tp=2, pp=2), options=WriteOptions(iteration="release"))
    write_torch_dist(src, dist, ParallelConfig(tp=2, pp=2))
    return legacy, dist


def _flush() -> None:
    """Write back every dirty page first (untimed): otherwise a measured step's ``sync``/fsync
    also pays for the step before it (the generated checkpoint, the previous output)."""
    subprocess.run(["sync"], check=False)


def _cp_seconds(src: Path, dst: Path) -> float:
    _flush()
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    subprocess.run(["sync", "-f", str(dst)], check=False)
    wall = time.perf_counter() - start
    shutil.rmtree(dst)
    return wall


REPO = Path(__file__).parents[1]
NPROC = 1  # processes per conversion (--nproc): more than 1 runs it under torchrun
REPEATS = 1  # (copy, conversion) pairs per conversion (--repeats): medians reported


def convert_command(argv: list[str], nproc: int) -> list[str]:
    """``python -m tools.convert_cli ARGV``, under ``torchrun --nproc-per-node NPROC`` when NPROC > 1."""
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    return [sys.executable, *launch, "-m", "tools.convert_cli", *argv]


def _convert(name: str, argv: list[str], source: Path, work: Path, output: Path) -> dict[str, object]:
    """:func:`_timed` :data:`REPEATS` times (``output`` removed between), then once more measured
    for memory (:func:`_peak_anon`; its output is kept): the medians (of the paired
    ``time_over_cp`` ratios too) and, with repeats, each run's ratio."""
    runs = []
    for _ in range(REPEATS):
        runs.append(_timed(name, argv, source, work))
        shutil.rmtree(output)
    out: dict[str, object] = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    out["peak_anon_gb"] = _peak_anon(name, argv)
    out["source_gb"] = round(_dir_bytes(source) / GB, 3)
    if REPEATS > 1:
        out["time_over_cp_runs"] = [round(r["time_over_cp"], 2) for r in runs]
    return out


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}


def _timed(name: str, argv: list[str], source: Path, work: Path) -> dict[str, float]:
    """Run ``python -m tools.convert_cli ARGV`` from :data:`REPO` (``--repo``) as a user runs it
    (no sampler beside it), right after a ``cp -r`` of its source on the same disk (the disk's
    speed drifts by 3x within minutes on a shared host: a copy timed once per size is not this
    conversion's baseline): wall and CPU seconds."""
    cp_s = _cp_seconds(source, work / f"cp_{name}")
    cmd = convert_command(argv, NPROC)
    _flush()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}): {(done.stdout + done.stderr)[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the conversion's processes, waited for
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "wall_s": wall,
        "mb_per_s": _dir_bytes(source) / 1e6 / wall,
        "time_over_cp": wall / cp_s,
        "cp_s": cp_s,  # the paired copy
        "cpu_s": cpu_s,  # user + system: what the conversion costs on a loaded host
    }


def _peak_anon(name: str, argv: list[str]) -> float:
    """Peak anonymous memory (GB) of the conversion's process tree, in a run of its own: the
    sampler reads ``/proc`` every millisecond and the children free memory back to the OS at once
    (:mod:`benchmarks.anon_memory`), which slows them, so no time is taken from this run."""
    _flush()
    m = run_measured(convert_command(argv, NPROC), cwd=REPO, env=_env())
    if m.returncode != 0:
        raise SystemExit(f"{name} failed ({m.returncode}): {m.output[-3000:]}")
    return round(m.peak_anon_bytes / GB, 3)


def measure_size(size: str, work: Path, only: frozenset[str] = frozenset(CONVERSIONS)) -> dict[str, object]:
    """Generate one size, run the conversions in ``only`` (from_hf needs to_hf), delete the outputs;
    the size's figures."""
    work.mkdir(parents=True)
    shapes = canonical_shapes(size)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    largest = max(torch.Size(s).numel() for s in shapes.values()) * 2
    t0 = time.perf_counter()
    legacy, dist = _generate(size, work)
    generate_s = time.perf_counter() - t0
    hf, out = work / "hf", work / "out"
    runs: dict[str, dict[str, float]] = {}
    runs["to_hf"] = _convert("to_hf", ["to-hf", "--load", str(legacy), "--save", str(hf), "--weights-only",
                                       "--no-verify", "--max-shard-size", "2GB"], legacy, work, hf)  # fmt: skip
    commands = {
        "reshard": (["reshard", "--load", str(legacy), "--save", str(out), "--target-tp", "4", "--target-pp", "1"],
                    legacy),
        "from_hf": (["from-hf", "--load", str(hf), "--save", str(out), "--tp", "2", "--pp", "2", "--weights-only"],
                    hf),
        "to_torch_dist": (["reshard", "--load", str(legacy), "--save", str(out), "--target-tp", "2",
                           "--target-pp", "2", "--ckpt-format", "torch_dist"], legacy),
        "torch_dist_to_hf": (["to-hf", "--load", str(dist), "--save", str(out), "--weights-only", "--no-verify",
                              "--max-shard-size", "2GB"], dist),
    }  # fmt: skip
    for name, (argv, source) in commands.items():
        if name in only:
            runs[name] = _convert(name, argv, source, work, out)
            shutil.rmtree(out)
    shutil.rmtree(work)
    return {
        "size": size, "params": params, "model_gb": round(params * 2 / GB, 3),
        "largest_tensor_gb": round(largest / GB, 3), "anon_bound_gb": round((2 * largest + 0.5 * GB) / GB, 3),
        "generate_s": round(generate_s, 1),
        **runs,
    }  # fmt: skip


def _slope(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def summarise(points: list[dict[str, object]]) -> dict[str, object]:
    """Slopes and goal checks over the measured sizes."""
    bparams = [float(p["params"]) / 1e9 for p in points]  # type: ignore[arg-type]
    slopes, met_memory, worst_speed, worst_over_cp = {}, True, float("inf"), 0.0
    for c in [c for c in CONVERSIONS if all(c in p for p in points)]:
        runs = [p[c] for p in points]
        slopes[c] = round(_slope(bparams, [r["peak_anon_gb"] for r in runs]), 4)  # type: ignore[index]
        for p, r in zip(points, runs, strict=True):
            met_memory &= r["peak_anon_gb"] <= p["anon_bound_gb"]  # type: ignore[index,operator]
            worst_speed = min(worst_speed, r["mb_per_s"])  # type: ignore[index]
            worst_over_cp = max(worst_over_cp, r["time_over_cp"])  # type: ignore[index]
    return {
        "anon_slope_gb_per_b_params": slopes, "max_anon_slope": max(slopes.values()),
        "memory_goal_met": met_memory, "min_mb_per_s": worst_speed, "max_time_over_cp": worst_over_cp,
        "throughput_goal_met": worst_speed >= 150 and worst_over_cp <= 2,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test, seconds)")
    g.add_argument("--large", action="store_true", help="add 7B")
    g.add_argument("--sizes", help="comma-separated sizes: " + ",".join(SIZES))
    p.add_argument("--workdir", type=Path, default=None, help="where checkpoints are generated (a temp dir)")
    p.add_argument("--conversions", default=",".join(CONVERSIONS), help="which to run (to_hf always runs)")
    p.add_argument("--plot", type=Path, default=None, help="write the curve here (.svg)")
    p.add_argument("--nproc", type=int, default=1, help="run each conversion as torchrun --nproc-per-node N")
    p.add_argument("--repeats", type=int, default=1,
                   help="time each conversion N times, each right after its own cp -r (medians)")  # fmt: skip
    p.add_argument("--repo", type=Path, default=None,
                   help="run the conversions from this checkout (e.g. main, for a before/after)")  # fmt: skip
    a = p.parse_args()
    global REPO, NPROC, REPEATS
    if a.repo is not None:
        REPO = a.repo.resolve()
    if a.nproc < 1:
        p.error(f"--nproc {a.nproc}: must be at least 1")
    NPROC = a.nproc
    if a.repeats < 1:
        p.error(f"--repeats {a.repeats}: must be at least 1")
    REPEATS = a.repeats
    sizes = QUICK if a.quick else LARGE if a.large else tuple(a.sizes.split(",")) if a.sizes else DEFAULT
    work = Path(tempfile.mkdtemp(dir=a.workdir, prefix="bench_convert_scale."))
    points = []
    try:
        for size in sizes:
            point = measure_size(size, work / size, frozenset(a.conversions.split(",")))
            print(json.dumps(point), flush=True)
            points.append(point)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.plot is not None:
        from benchmarks.convert_scale_plot import write_svg

        write_svg(points, a.plot)
    print(json.dumps({"benchmark": "convert_scale", "repo": str(REPO), "nproc": NPROC, "repeats": REPEATS, "sizes": points,
                      **summarise(points)}))  # fmt: skip


if __name__ == "__main__":
    main()
