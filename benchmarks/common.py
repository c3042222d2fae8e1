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
