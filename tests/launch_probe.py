"""A rank that reports what its launcher gave it (``python -m tests.launch_probe [FAIL_RANK]``):
one JSON line with its rank, the world, the sum of every rank's rank over gloo, the launcher's
variables it sees, ``sys.argv[0]`` and its torch threads. With ``FAIL_RANK`` that rank exits 2
after the line and every other rank then waits (up to 300 s) to be stopped by its launcher."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "ROLE_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                  "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS")  # fmt: skip


def main() -> int:
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    seen = {k: os.environ.get(k) for k in _LAUNCHER_VARS}
    line = json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": int(total), "env": seen,
                       "has_run_id": bool(os.environ.get("TORCHELASTIC_RUN_ID")),
                       "argv0": os.path.basename(sys.argv[0]), "threads": torch.get_num_threads()})  # fmt: skip
    os.write(1, (line + "\n").encode())  # one write: the ranks share the launcher's stdout
    dist.destroy_process_group()
    if not sys.argv[1:]:
        return 0
    if sys.argv[1] == os.environ["RANK"]:
        return 2
    time.sleep(300)  # the launcher must stop this rank once the failing one has exited
    return 0


if __name__ == "__main__":
    sys.exit(main())
