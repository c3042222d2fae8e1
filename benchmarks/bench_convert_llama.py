"""Convert a Llama-shaped ``torch_dist`` checkpoint (saved by us at tp2 pp2) to Hugging Face.

A random GQA Llama model (default about 1B parameters, bf16) is written with our ``torch_dist``
writer (streaming: each tensor generated when the file writer reaches it), then converted to HF
twice, each in a fresh process whose peak RSS is measured:

* ``streaming``: ``mlm-convert to-hf`` (the reader loads one layer's region of one key at a time);
* ``load_all``: what upstream converters do, every tensor of the checkpoint loaded into memory
  first (one ``torch.distributed.checkpoint.load`` of the whole state dict), then exported.

Target: streaming peak RSS <= 1.5x the model's bytes. The last line is one JSON object.
Usage: ``python -m benchmarks.bench_convert_llama [--size 1b|300m|tiny] [--workdir DIR]``.
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

import torch

try:  # run as ``python benchmarks/<script>.py`` (benchmarks/ on sys.path) or as a module
    from common import save_synthetic_torch_dist
except ImportError:
    from benchmarks.common import save_synthetic_torch_dist

SIZES = {  # layers, hidden, heads, groups, ffn, vocab
    "1b": (20, 2048, 16, 4, 5632, 32000),
    "300m": (12, 1024, 16, 4, 2816, 32000),
    "tiny": (2, 128, 8, 2, 256, 1000),
}


def _config(size: str):  # noqa: ANN202
    from pretrain.config import ModelConfig

    layers, hidden, heads, groups, ffn, vocab = SIZES[size]
    return ModelConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=ffn, vocab_size=vocab, max_position_embeddings=4096, normalization="RMSNorm",
        swiglu=True, position_embedding_type="rope", untie_embeddings_and_output_weights=True,
        add_bias_linear=False, params_dtype="bfloat16",
    )  # fmt: skip


def _save(size: str, out: Path) -> int:
    return save_synthetic_torch_dist(_config(size), out)


def _load_all(ckpt: Path, save: Path) -> None:
    """Upstream style: the whole state dict in memory, then the export."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from pretrain.checkpoint.opener import open_checkpoint
    from tools.hf_io import export_hf

    reader = open_checkpoint(ckpt)
    it_dir = reader.path
    md = FileSystemReader(str(it_dir)).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.items()
             if isinstance(v, TensorStorageMetadata)}  # fmt: skip
    dcp.load(state, storage_reader=FileSystemReader(str(it_dir)), no_dist=True)
    vocab = reader.spec.cfg.vocab_size
    tensors = []
    for name in reader.names():
        ref = reader.refs[name]
        t = state[ref.key] if ref.layer is None else state[ref.key][ref.layer]
        tensors.append(
            (name, t[:vocab] if t.shape[0] > vocab and name.endswith("weight") and ref.layer is None else t)
        )
    export_hf(iter(tensors), reader.spec, save)


def _child(mode: str, ckpt: Path, save: Path) -> None:
    start = time.perf_counter()
    if mode == "streaming":
        from tools.convert_cli import main

        assert main(["to-hf", "--load", str(ckpt), "--save", str(save), "--weights-only"]) == 0
    else:
        _load_all(ckpt, save)
    wall = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"wall_s": round(wall, 2), "peak_rss_bytes": rss}))


def _measure(mode: str, ckpt: Path, save: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "benchmarks.bench_convert_llama", "--child", mode, str(ckpt), str(save)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="1b")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        _child(a.child[0], Path(a.child[1]), Path(a.child[2]))
        return
    work = Path(tempfile.mkdtemp(dir=a.workdir, prefix="bench_convert_llama."))
    try:
        t0 = time.perf_counter()
        model_bytes = _save(a.size, work / "ckpt")
        save_s = time.perf_counter() - t0
        streaming = _measure("streaming", work / "ckpt", work / "hf_streaming")
        load_all = _measure("load_all", work / "ckpt", work / "hf_load_all")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = streaming["peak_rss_bytes"] / model_bytes
    print(json.dumps({
        "benchmark": "convert_llama_torch_dist_to_hf", "size": a.size, "params": model_bytes // 2,
        "model_bytes": model_bytes, "save_torch_dist_s": round(save_s, 2), "streaming": streaming,
        "load_all": load_all, "streaming_rss_over_model": round(ratio, 3),
        "load_all_rss_over_model": round(load_all["peak_rss_bytes"] / model_bytes, 3),
        "target_rss_over_model": 1.5, "target_met": ratio <= 1.5,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
