"""Shared measurement helpers for the benchmark scripts."""

from __future__ import annotations

import statistics
import time

import torch


def matmul_peak_flops(n: int = 2048, reps: int = 5) -> float:
    """This machine's fp32 matmul peak: median FLOP/s of an ``n x n`` GEMM."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)
