"""``tests.distributed.launch`` (ranks forked from one process, :mod:`tests.forked_launch`) gives a
command what ``torch.distributed.run --standalone`` gives it: the same launcher variables, a
working gloo rendezvous, ``python -m``'s ``sys.argv[0]``, one thread per rank; and a failing rank
ends the launch with torchrun's exit code 1 and stops the other ranks."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.distributed import launch, torchrun


def _ranks(stdout: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda r: int(r["rank"]))


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_launch_gives_the_ranks_what_torchrun_gives(nproc: int) -> None:
    ours, theirs = launch(nproc, "tests.launch_probe", []), torchrun(nproc, "tests.launch_probe", [])
    assert ours.returncode == theirs.returncode == 0, ours.stderr[-2000:] + theirs.stderr[-2000:]
    got, want = _ranks(ours.stdout), _ranks(theirs.stdout)
    assert len(got) == nproc and got == want
    assert all(r["sum"] == nproc * (nproc - 1) // 2 and r["has_run_id"] and r["threads"] == 1 for r in got)


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
def test_a_failing_rank_ends_the_launch_with_code_1_and_stops_the_others() -> None:
    start = time.monotonic()
    proc = launch(2, "tests.launch_probe", ["1"])
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == "forked_launch: rank 1 exited with code 2"
    assert [r["rank"] for r in _ranks(proc.stdout)] == [0, 1]  # both got through the rendezvous
    assert time.monotonic() - start < 60  # rank 0 would wait 300 s: the launcher stopped it
