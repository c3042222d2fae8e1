"""A torchrun stand-in for tests: ``python -m tests.forked_launch N MODULE [ARG ...]`` runs ``python -m
MODULE ARG ...`` on ``N`` ranks forked from one process that has imported torch once
(``--preload=MODULE:FUNCTION`` options before ``N``: functions run here before the forks).

Under ``torch.distributed.run`` every launch costs the agent's interpreter and torch import and then
one more interpreter and torch import per rank: about 6.6 s for two ranks that do nothing on a
2-core host, most of a short test run. Here the ranks are ``fork``s of this process taken right
after ``import torch`` and ``torch._dynamo`` (which the first ``torch.optim`` optimizer of a
process imports: 2.6 s; no torch op has run, so no thread pool exists to break), each then a fresh
``python -m MODULE`` as far as the command can tell:

* the rendezvous is torchrun's: this process holds the TCP store (port chosen by the kernel, so no
  race for a free port) and each rank finds it through ``MASTER_ADDR``/``MASTER_PORT`` with
  ``TORCHELASTIC_USE_AGENT_STORE=True``; ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE`` and
  ``TORCHELASTIC_RUN_ID`` / ``_RESTART_COUNT`` / ``_MAX_RESTARTS`` are set as torchrun sets them;
* ``OMP_NUM_THREADS`` defaults to 1 (torchrun's default with several ranks per host), before torch
  is imported, since OpenMP reads it when its library loads;
* the ranks write to this process's stdout and stderr, unprefixed (torchrun without ``--tee``);
* when a rank fails the others get SIGTERM (SIGKILL 30 s later) and this process exits 1 (torchrun's code) after one
  line ``forked_launch: rank R exited with code C`` on stderr; a rank dies with this process
  (``PR_SET_PDEATHSIG``), so a test's timeout leaves none behind.

Tests of torchrun's own behaviour (its messages, its exit codes) run the real launcher
(:func:`tests.distributed.torchrun`); this one is for runs whose ranks are what is tested.
"""

from __future__ import annotations

import importlib
import os
import runpy
import signal
import socket
import sys
import uuid

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch._dynamo  # noqa: E402, F401  (torch.optim's first optimizer imports it: 2.6 s a rank otherwise)
import torch.distributed as dist  # noqa: E402  (after OMP_NUM_THREADS: the ranks inherit the import)

from pretrain.utils.libc import libc  # noqa: E402

_PR_SET_PDEATHSIG = 1
_GRACE_S = 30  # torchrun's default before SIGKILL


def _become_rank(rank: int, world: int, port: int, run_id: str) -> None:
    """This forked process becomes rank ``rank``: torchrun's environment, and it dies with the launcher."""
    c_library = libc()
    if c_library is not None:  # Linux: the kernel kills this rank when the launcher dies
        c_library.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the line above took effect
        os._exit(1)
    for key, value in {
        "RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "ROLE_RANK": rank, "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": world, "ROLE_WORLD_SIZE": world, "ROLE_NAME": "default", "MASTER_ADDR": "localhost",
        "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": 0,
        "TORCHELASTIC_MAX_RESTARTS": 0, "TORCHELASTIC_USE_AGENT_STORE": True,
    }.items():  # fmt: skip
        os.environ[key] = str(value)


def launch(world: int) -> int | None:
    """Fork ``world`` ranks and wait for them. In a rank: None (it goes on to run the command). In
    the launcher: 0 when every rank exited 0, else 1 (the others are then stopped, as torchrun
    stops them)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=world)  # the kernel picks a free port
    port, run_id = listener.getsockname()[1], uuid.uuid4().hex
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(world):  # every fork before the store starts its server thread
        pid = os.fork()
        if pid == 0:
            listener.close()
            _become_rank(rank, world, port, run_id)
            return None
        pids[pid] = rank
    # the ranks' connections wait in the listener's backlog until the store accepts them
    store = dist.TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False,
                          master_listen_fd=listener.detach())  # fmt: skip
    failed: tuple[int, int] | None = None
    while pids:
        pid, status = os.wait()
        rank = pids.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            failed = (rank, code)
            for other in pids:  # torchrun stops the other workers when one fails
                os.kill(other, signal.SIGTERM)
            # and kills those still there after its grace period (one that ignores SIGTERM)
            signal.signal(signal.SIGALRM, lambda *_: [os.kill(other, signal.SIGKILL) for other in pids])
            signal.alarm(_GRACE_S)
    del store
    if failed is not None:
        print(f"forked_launch: rank {failed[0]} exited with code {failed[1]}", file=sys.stderr)
        return 1
    return 0


def preload(specs: list[str]) -> None:
    """Run each ``MODULE:FUNCTION`` here, before the forks, so that every rank inherits its work
    (e.g. :func:`tests.lm_eval_index.warm`: the harness's task index, built once)."""
    for spec in specs:
        module, _, function = spec.partition(":")
        getattr(importlib.import_module(module), function)()


if __name__ == "__main__":
    args = sys.argv[1:]
    specs = [a.removeprefix("--preload=") for a in args if a.startswith("--preload=")]
    args = args[len(specs) :]
    if len(args) < 2 or not args[0].isdigit():
        sys.exit(
            "usage: python -m tests.forked_launch [--preload=MODULE:FUNCTION ...] NPROC MODULE [ARG ...]"
        )
    world, module, argv = int(args[0]), args[1], args[2:]
    preload(specs)
    code = launch(world)
    if code is not None:
        sys.exit(code)
    # a rank: ``python -m module argv`` in this interpreter, which then exits as that one would
    # (SystemExit's code, a traceback and 1 for an exception, atexit handlers run)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
