"""Run a test function in N gloo processes started with ``fork`` (much faster than spawn).

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in each process
after ``torch.distributed`` is initialised with gloo over a file store in a fresh temporary
directory (no ports to collide). Each rank's return value (tensors, numbers, lists, dicts) is
saved with ``torch.save`` and loaded back with ``weights_only=True``; a failing rank's traceback
is re-raised in the test.

``torchrun(nproc, module, argv)`` launches a command-line module under ``torch.distributed.run``
(``--standalone``: a free port each time, so parallel launches never collide).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
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


REPO = Path(__file__).resolve().parents[1]


def torchrun(
    nproc: int, module: str, argv: list[str], *, timeout: float = 600.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m MODULE ARGV...`` from the repo.

    ``--standalone`` lets the launcher pick a free port, so any number of launches may run side by
    side. One thread per process (``OMP_NUM_THREADS=1``), no hub access; output captured as text.
    """
    return subprocess.run(
        torchrun_command(nproc, module, argv),
        cwd=REPO,
        env=torchrun_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torchrun_command(nproc: int, module: str, argv: list[str]) -> list[str]:
    """The command line :func:`torchrun` runs (for tests that start launches with ``Popen``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, *argv]  # fmt: skip


def torchrun_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of :func:`torchrun`: this one plus one thread, offline hub, repo on the path."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO),
        **(extra or {}),
    }
