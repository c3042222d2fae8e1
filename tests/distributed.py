"""Run a test function in N processes: gloo + ``fork`` on the CPU, NCCL + ``spawn`` on GPUs.

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in each process
after ``torch.distributed`` is initialised over a file store in a fresh temporary directory (no
ports to collide). The default is gloo with ``fork`` (much faster than spawn);
``backend="nccl", start_method="spawn"`` (CUDA cannot fork) puts rank r on GPU r with TF32 off,
so fp32 on the GPU is fp32. Each rank's return value (tensors, numbers, lists, dicts) is moved to
the CPU, saved with ``torch.save`` and loaded back with ``weights_only=True``; a failing rank's
traceback is re-raised in the test.

``torchrun(nproc, module, argv)`` launches a command-line module under ``torch.distributed.run``
(``--standalone``: a free port each time, so parallel launches never collide). ``launch(nproc,
module, argv)`` runs it the same way on ranks forked from one process that imported torch once
(:mod:`tests.forked_launch`: torchrun's environment and rendezvous, 3-4 s less per launch); tests
of the launcher's own behaviour (its messages and exit codes) use ``torchrun``.
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
from typing import Any, Literal

import torch
import torch.distributed as dist


def to_device(obj: Any, device: str | torch.device) -> Any:
    """Tensors inside dicts/lists/tuples moved to ``device`` (other values unchanged)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def _worker(
    fn: Callable[..., Any], rank: int, world: int, tmp: str, backend: str, args: tuple[Any, ...]
) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        if backend == "nccl":  # one rank per GPU (NCCL cannot put two ranks on one device)
            torch.cuda.set_device(rank)
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world)
        torch.save(to_device(fn(rank, world, *args), "cpu"), f"{tmp}/result{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(f"{tmp}/error{rank}.txt").write_text(traceback.format_exc())
        code = 1
    os._exit(code)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    start_method: Literal["fork", "spawn"] = "fork",
    timeout: float = 240.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return per-rank results.

    ``backend`` is the ``torch.distributed`` backend (``"gloo"`` or ``"nccl"``), ``start_method``
    the multiprocessing start method (``"fork"``; ``"spawn"`` for CUDA, which needs ``fn`` and
    ``args`` picklable: module-level functions). ``timeout`` bounds each rank's join in seconds.
    """
    ctx = mp.get_context("spawn") if start_method == "spawn" else mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, tmp, backend, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = [Path(tmp, f"error{r}.txt") for r in range(world_size)]
        messages = [f"--- rank {r} ---\n{e.read_text()}" for r, e in enumerate(errors) if e.exists()]
        if messages:
            raise AssertionError(f"distributed test ({backend}) failed:\n" + "\n".join(messages))
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
    return _run(torchrun_command(nproc, module, argv), timeout, env)


def launch(
    nproc: int, module: str, argv: list[str], *, timeout: float = 600.0, env: dict[str, str] | None = None,
    preload: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """:func:`torchrun`'s run on forked ranks (:mod:`tests.forked_launch`); a failed rank makes the
    launch exit 1 after the line ``forked_launch: rank R exited with code C``. ``preload``:
    ``MODULE:FUNCTION``s the launcher runs before forking (e.g. :data:`tests.lm_eval_index.LM_EVAL_INDEX`)."""
    return _run(launch_command(nproc, module, argv, preload=preload), timeout, env)


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, cwd=REPO, env=torchrun_env(env), capture_output=True, text=True, timeout=timeout
    )


def launch_command(nproc: int, module: str, argv: list[str], *, preload: tuple[str, ...] = ()) -> list[str]:
    """The command line :func:`launch` runs (for tests that start launches with ``Popen``)."""
    return [sys.executable, "-m", "tests.forked_launch", *(f"--preload={p}" for p in preload), str(nproc), module,
            *argv]  # fmt: skip


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
