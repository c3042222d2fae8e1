"""One writer per output directory: while a run writes ``--save X``, every other command given the
same ``X`` (to-hf, from-hf, reshard, mlm-pretrain, mlm-finetune) is refused at once with one line
naming the writer's pid, exit 2; the lock goes with its run (finished, failed or killed)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.builtin import builtin_task_dir
from finetune.cli import main as finetune_main
from pretrain.training.cli import main as pretrain_main
from pretrain.utils.output_lock import lock_file_for
from pretrain.utils.outputs import check_writable_output
from tests.cli_helpers import one_line_error
from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tests.slow_hook import REPO, start_held
from tests.train_fixtures import gpt_args
from tools.convert_cli import main as convert_main

HF_WRITE = "tools.hf_shards:ShardWriter.add"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config()
    return write_ours(tmp_path_factory.mktemp("lock") / "ck", cfg, full_weights(cfg), tp=1, pp=1)


def _to_hf(ckpt: Path, save: Path) -> list[str]:
    return ["to-hf", "--load", str(ckpt), "--save", str(save), "--weights-only"]


def _hold(ckpt: Path, save: Path, marker: Path) -> subprocess.Popen[str]:
    """A real ``mlm-convert to-hf --save SAVE`` process, held while it writes its first tensor."""
    return start_held(HF_WRITE, marker, "tools.convert_cli", _to_hf(ckpt, save))


@pytest.mark.slow
def test_a_second_writer_is_refused_while_the_first_writes(
    ckpt: Path,
    gpt_data: dict[str, str],
    tiny_gpt2_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    save, marker = tmp_path / "X", tmp_path / "hooked"
    first = _hold(ckpt, save, marker)
    refusal = f"error: --save {save}: another process is writing it (pid {first.pid})"
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    second = subprocess.run([sys.executable, "-m", "tools.convert_cli", *_to_hf(ckpt, save)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert second.returncode == 2 and second.stderr.strip() == refusal, second.stderr[-3000:]
    assert "wrote" not in second.stdout
    for main, argv in (
        (
            convert_main,
            ["reshard", "--load", str(ckpt), "--save", str(save), "--target-tp", "2", "--target-pp", "1"],
        ),
        (
            convert_main,
            ["from-hf", "--load", str(tiny_gpt2_dir), "--save", str(save), "--tp", "1", "--pp", "1"],
        ),
        (pretrain_main, gpt_args(gpt_data, save=save)),
        (
            finetune_main,
            [
                "sst2",
                "--data-dir",
                str(builtin_task_dir("sst2_tiny")),
                "--no-progress",
                "--hf-model",
                str(tmp_path / "not-read-yet"),
                "--save",
                str(save),
            ],
        ),  # fmt: skip
    ):
        assert one_line_error(main, argv, capsys) == refusal
    marker.unlink()  # let the first run finish
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0 and f"wrote {save}" in out, err[-3000:]
    assert (save / "config.json").exists() and not lock_file_for(save).exists()


@pytest.mark.slow
def test_a_killed_writer_leaves_no_lock(ckpt: Path, tmp_path: Path) -> None:
    save = tmp_path / "X"
    first = _hold(ckpt, save, tmp_path / "hooked")
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    assert lock_file_for(save).exists()  # left behind, but the kernel released its lock
    assert convert_main(_to_hf(ckpt, save)) == 0
    assert (save / "config.json").exists() and not lock_file_for(save).exists()


def test_the_lock_ends_with_the_command(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save = tmp_path / "X"
    for _ in range(2):  # the same output again from the same process: the first run's lock is gone
        shutil.rmtree(save, ignore_errors=True)
        assert convert_main(_to_hf(ckpt, save)) == 0
        assert not lock_file_for(save).exists()
    capsys.readouterr()
    err = one_line_error(convert_main, _to_hf(ckpt, save), capsys)  # a failed run releases it too
    assert "exists and is not empty" in err
    assert not lock_file_for(save).exists()


def test_a_failed_run_leaves_no_folder_its_lock_needed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save = tmp_path / "a" / "b" / "X"
    argv = [
        "reshard",
        "--load",
        str(tmp_path / "none"),
        "--save",
        str(save),
        "--target-tp",
        "1",
        "--target-pp",
        "1",
    ]
    assert "no such checkpoint directory" in one_line_error(convert_main, argv, capsys)
    assert list(tmp_path.iterdir()) == []


def test_results_directories_and_other_ranks_take_no_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_writable_output(tmp_path / "results", kind="dir", flag="--results-dir", shared=True)
    monkeypatch.setenv("RANK", "1")  # a torchrun rank other than 0: rank 0 holds the run's lock
    check_writable_output(tmp_path / "save", kind="dir", flag="--save")
    assert list(tmp_path.iterdir()) == []
