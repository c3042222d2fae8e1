"""``tools.forked_job.ForkedJob``: work done in a forked child (its files stay), the child's
``UserError`` raised in the parent with its line, and the work done again in the parent when the
child crashes, is stuck past the timeout or cannot fork. ``to-hf`` makes its config and tokenizer
files that way: byte for byte the files it makes in-process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import tools.hf_io
from pretrain.utils.errors import UserError
from tools.convert_cli import main as convert_main
from tools.forked_job import ForkedJob


def _writer(path: Path, parent: int, *, child_does: str = "write"):
    """Write ``path`` with the pid that wrote it; in the child, ``child_does`` may instead fail or hang."""

    def work() -> None:
        if os.getpid() != parent:
            if child_does == "user_error":
                raise UserError("--thing: the child says no")
            if child_does == "crash":
                raise RuntimeError("a bug in the child")
            if child_does == "hang":
                time.sleep(60)
        path.write_text(str(os.getpid()))

    return work


def test_the_work_runs_in_a_child_and_its_files_stay(tmp_path: Path) -> None:
    out = tmp_path / "made"
    job = ForkedJob(_writer(out, os.getpid()))
    job.wait()
    assert int(out.read_text()) != os.getpid()


def test_a_user_error_of_the_child_is_raised_with_its_line(tmp_path: Path) -> None:
    job = ForkedJob(_writer(tmp_path / "made", os.getpid(), child_does="user_error"))
    with pytest.raises(UserError, match=r"^--thing: the child says no$"):
        job.wait()
    assert not (tmp_path / "made").exists()  # not run again: the parent would say the same


@pytest.mark.parametrize("child_does", ["crash", "hang"])
def test_a_child_that_crashes_or_hangs_leaves_the_work_to_the_parent(tmp_path: Path, child_does: str) -> None:
    out = tmp_path / "made"
    job = ForkedJob(_writer(out, os.getpid(), child_does=child_does))
    start = time.monotonic()
    job.wait(timeout=1.0)
    assert int(out.read_text()) == os.getpid() and time.monotonic() - start < 30


def test_without_fork_the_parent_does_the_work_when_asked(tmp_path: Path) -> None:
    out = tmp_path / "made"
    job = ForkedJob(_writer(out, os.getpid()), fork=False)
    assert not out.exists()
    job.wait()
    assert int(out.read_text()) == os.getpid()


def test_cancel_ends_a_running_child(tmp_path: Path) -> None:
    out = tmp_path / "made"
    job = ForkedJob(_writer(out, os.getpid(), child_does="hang"))
    pid = job._pid
    assert pid is not None
    job.cancel()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped: no zombie left
    assert not out.exists()


def test_to_hf_config_and_tokenizer_files_equal_the_in_process_ones(
    trained_gpt: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outs = {}
    for fork in (True, False):
        monkeypatch.setattr(tools.hf_io, "FORK_HF_FILES", fork)
        outs[fork] = tmp_path / f"hf_fork_{fork}"
        assert convert_main(["to-hf", "--load", trained_gpt["ckpt"], "--save", str(outs[fork])]) == 0
    files = sorted(p.name for p in outs[True].iterdir())
    assert files == sorted(p.name for p in outs[False].iterdir())
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    for name in files:
        assert (outs[True] / name).read_bytes() == (outs[False] / name).read_bytes(), name
