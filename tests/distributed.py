"""Run a test function in N gloo processes started with ``fork`` (much faster than spawn).

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in each process
after ``torch.distributed`` is initialised with gloo over a file store in a fresh temporary
directory (no ports to collide). Each rank's return value (tensors, numbers, lists, dicts) is
saved with ``torch.save`` and loaded back with ``weights_only=True``; a failing rank's traceback
is re-raised in the test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _worker(fn: Callable[..., Any], rank: int, world: int, tmp: str, args: tuple[Any, ...]) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.save(result, f"{tmp}/result{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(f"{tmp}/error{rank}.txt").write_text(traceback.format_exc())
        code = 1
    os._exit(code)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return per-rank results."""
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, tmp, args)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = [Path(tmp, f"error{r}.txt") for r in range(world_size)]
        messages = [f"--- rank {r} ---\n{e.read_text()}" for r, e in enumerate(errors) if e.exists()]
        if messages:
            raise AssertionError("distributed test failed:\n" + "\n".join(messages))
        if any(p.exitcode != 0 for p in procs):
            raise AssertionError(
                f"ranks exited with codes {[p.exitcode for p in procs]} (timeout {timeout}s?)"
            )
        return [torch.load(f"{tmp}/result{r}.pt", weights_only=True) for r in range(world_size)]
