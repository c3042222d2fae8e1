"""Shared measurement helpers for the benchmark scripts."""

from __future__ import annotations

import statistics
import time

import torch


def matmul_peak_flops(n: int = 2048, reps: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """This machine's matmul peak for ``dtype``: median FLOP/s of an ``n x n`` GEMM (CPU)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def model_flops_per_token(n_params: int, *, layers: int, hidden: int, seq: int) -> float:
    """Training FLOPs per token: 6 N (forward + backward GEMMs) + 12 L h s (attention scores)."""
    return 6 * n_params + 12 * layers * hidden * seq


class RandomCanonicalSource:
    """The canonical tensors of a GPT-kind ``cfg`` made on demand in bf16 (seeded by name), so a
    synthetic checkpoint is written with no model in memory."""

    def __init__(self, cfg) -> None:  # noqa: ANN001 (a pretrain ModelConfig; imported lazily)
        from pretrain.checkpoint.plan import ModelSpec, chunk_slots

        self.spec = ModelSpec(kind="gpt", cfg=cfg)
        slots = chunk_slots(
            self.spec, tp=1, pre_process=True, post_process=True, layer_numbers=range(cfg.num_layers)
        )
        self.shapes = {s.canonical: ((cfg.vocab_size, *s.shape[1:]) if s.vocab else s.shape) for s in slots}

    def names(self) -> list[str]:
        return list(self.shapes)

    def tensor(self, name: str) -> torch.Tensor:
        gen = torch.Generator().manual_seed(sum(map(ord, name)))
        return (0.02 * torch.randn(self.shapes[name], generator=gen)).to(torch.bfloat16)

    def stored_rows(self, name: str) -> torch.Tensor:  # no padding rows stored
        return self.tensor(name)


def save_synthetic_torch_dist(cfg, out) -> int:  # noqa: ANN001
    """Write ``cfg``'s synthetic bf16 checkpoint to ``out`` as torch_dist at tp2 pp2; its bytes."""
    from pretrain.checkpoint.torch_dist.writer import write_torch_dist
    from pretrain.parallel.config import ParallelConfig

    src = RandomCanonicalSource(cfg)
    write_torch_dist(src, out, ParallelConfig(tp=2, pp=2))
    return sum(torch.Size(s).numel() for s in src.shapes.values()) * 2
