"""mlm-pretrain at its edges: outputs checked before work, no silent overwrite, resume and exit flags,
one-line errors for bad data, outputs that follow the umask, nothing half-made left behind."""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import numpy as np
import pytest

import pretrain.checkpoint.legacy.io as ckpt_io
from pretrain.data.indexed_dataset_builder import IndexedDatasetBuilder
from pretrain.training.cli import main as pretrain_main
from pretrain.training.logger import TrainingLogger
from tests.train_fixtures import gpt_args


def _losses(path: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run mlm-pretrain expecting exit 2; the one stderr line."""
    with pytest.raises(SystemExit) as exc:
        pretrain_main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write in: chmod 0555, or a read-only /sys path for root."""
    if os.geteuid() != 0:
        d = tmp_path / "readonly"
        d.mkdir()
        d.chmod(0o555)
        return d
    if os.path.isdir("/sys") and not os.access("/sys", os.W_OK):
        return Path("/sys")
    try:
        open("/sys/.mlm-probe", "w").close()  # noqa: SIM115
    except OSError:
        return Path("/sys")
    pytest.skip("no unwritable directory for root here")


# ------------------------------------------------------------------------------------------ outputs


@pytest.mark.parametrize("where", ["under-a-file", "read-only"])
def test_unwritable_save_is_refused_before_training(
    gpt_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    if where == "under-a-file":
        (tmp_path / "file").write_text("x")
        save = tmp_path / "file" / "ck"
    else:
        save = unwritable_dir(tmp_path) / "ck"
    log = tmp_path / "log.jsonl"
    err = _fails(gpt_args(gpt_data, **{"save": save, "log-json": log}), capsys)
    assert err.startswith(f"error: --save {save}:")
    assert not log.exists()  # no iteration ran


def test_existing_save_needs_load_or_overwrite(
    gpt_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "ck"
    assert pretrain_main(gpt_args(gpt_data, **{"train-iters": 4, "save": ck})) == 0
    err = _fails(gpt_args(gpt_data, **{"train-iters": 2, "save": ck}), capsys)
    assert "already holds a checkpoint (iteration 4)" in err and "--load" in err and "--overwrite" in err
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert pretrain_main(gpt_args(gpt_data, **{"train-iters": 2, "save": ck, "overwrite": True})) == 0
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_checkpoint_and_log_follow_the_umask(gpt_data: dict[str, str], tmp_path: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        assert pretrain_main(gpt_args(gpt_data, **{"train-iters": 1, "save": tmp_path / "ck"})) == 0
    finally:
        os.umask(old)
    paths = [p for p in (tmp_path / "ck").rglob("*")]
    assert paths and not [p for p in paths if p.name.endswith(".tmp")]
    for p in paths:
        want = (0o777 if p.is_dir() else 0o666) & ~mask
        assert stat.S_IMODE(p.stat().st_mode) == want, (p, oct(p.stat().st_mode))


# ------------------------------------------------------------------------------- resume and exit


def test_longer_resume_names_the_scheduler_flags(
    gpt_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cosine = {"lr-decay-style": "cosine", "lr-warmup-iters": 1}
    assert pretrain_main(gpt_args(gpt_data, **{**cosine, "train-iters": 3, "save": tmp_path / "ck"})) == 0
    longer = gpt_args(gpt_data, **{**cosine, "train-iters": 5, "load": tmp_path / "ck"})
    err = _fails(longer, capsys)
    assert "--override-opt_param-scheduler" in err and "--use-checkpoint-opt_param-scheduler" in err
    assert "pass override" not in err
    for flag in ("override-opt_param-scheduler", "use-checkpoint-opt_param-scheduler"):
        log = tmp_path / f"{flag}.jsonl"
        assert pretrain_main(gpt_args(gpt_data, **{**cosine, "train-iters": 5, "load": tmp_path / "ck",
                                                   flag: True, "log-json": log})) == 0  # fmt: skip
        lrs = [json.loads(line)["lr"] for line in log.read_text().splitlines()]
        # iteration 4's lr: cosine over 5 iterations (this run) or over 3 (the checkpoint: past the end)
        assert len(lrs) == 2
        if flag.startswith("use"):
            assert lrs == [1e-5, 1e-5]  # min lr, the checkpoint's schedule ended at 3
        else:
            assert lrs[0] > 1e-4


def test_lr_warmup_fraction_equals_warmup_iters(gpt_data: dict[str, str], tmp_path: Path) -> None:
    runs = {}
    for name, flags in (("frac", {"lr-warmup-fraction": 0.5}), ("iters", {"lr-warmup-iters": 2})):
        log = tmp_path / f"{name}.jsonl"
        assert (
            pretrain_main(gpt_args(gpt_data, **{"lr-decay-style": "linear", **flags, "log-json": log})) == 0
        )
        runs[name] = [json.loads(line)["lr"] for line in log.read_text().splitlines()]
    assert runs["frac"] == runs["iters"] and runs["frac"][0] == pytest.approx(0.0)


def test_exit_interval_saves_and_stops(gpt_data: dict[str, str], tmp_path: Path) -> None:
    log = tmp_path / "a.jsonl"
    argv = gpt_args(
        gpt_data, **{"train-iters": 6, "exit-interval": 2, "save": tmp_path / "ck", "log-json": log}
    )
    assert pretrain_main(argv) == 0
    assert len(_losses(log)) == 2
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_sigterm_saves_a_checkpoint_whose_continuation_is_bitwise_equal(
    gpt_data: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = {"train-iters": 6, "hidden-dropout": 0.1, "attention-dropout": 0.1, "lr-decay-style": "cosine",
              "lr-warmup-iters": 2}  # fmt: skip
    assert pretrain_main(gpt_args(gpt_data, **common, **{"log-json": tmp_path / "full.jsonl"})) == 0
    real = TrainingLogger.iteration

    def iteration(self: TrainingLogger, record: dict) -> None:
        real(self, record)
        if record["iteration"] == 3:  # a scheduler's preemption notice, mid-run (a real signal)
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(TrainingLogger, "iteration", iteration)
    first = gpt_args(gpt_data, **common, **{"save": tmp_path / "ck", "log-json": tmp_path / "a.jsonl",
                                            "exit-signal-handler": True})  # fmt: skip
    assert pretrain_main(first) == 0
    monkeypatch.setattr(TrainingLogger, "iteration", real)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is gone again
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    resumed = gpt_args(gpt_data, **common, **{"load": tmp_path / "ck", "log-json": tmp_path / "b.jsonl"})
    assert pretrain_main(resumed) == 0
    a, b = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "b.jsonl")
    assert len(a) == 3 and len(b) == 3
    assert a + b == _losses(tmp_path / "full.jsonl")  # bitwise


def test_interrupted_save_leaves_no_temporary_directory(
    gpt_data: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real, calls = ckpt_io.stream_save, []  # what a rank file is written with

    def save(obj, fh, *a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:  # Ctrl-C while the second checkpoint is written
            raise KeyboardInterrupt
        return real(obj, fh, *a, **k)

    monkeypatch.setattr(ckpt_io, "stream_save", save)
    flags = gpt_args(gpt_data, **{"train-iters": 4, "save": tmp_path / "ck", "save-interval": 2})
    with pytest.raises(SystemExit) as exc:
        pretrain_main(flags)
    assert exc.value.code == 130
    names = {p.name for p in (tmp_path / "ck").iterdir()}
    assert "iter_0000002" in names and not [n for n in names if n.startswith("iter_0000004")], names


def test_stale_temporary_from_a_killed_run_is_removed(gpt_data: dict[str, str], tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    (ck / "iter_0000009.tmp" / "mp_rank_00").mkdir(parents=True)
    assert pretrain_main(gpt_args(gpt_data, **{"train-iters": 1, "save": ck})) == 0
    assert not list(ck.glob("*.tmp"))


# ------------------------------------------------------------------------------------ bad input


def _dataset(tmp_path: Path, docs: list[list[int]]) -> str:
    prefix = tmp_path / "bad_text_document"
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as b:
        for doc in docs:
            b.add_document(doc)
        b.finalize()
    return str(prefix)


def test_token_ids_beyond_the_vocabulary_are_one_line(
    gpt_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = _dataset(tmp_path, [[1, 2, 3] * 40, [5, 60000, 7] * 40])
    err = _fails(gpt_args({**gpt_data, "data": prefix}), capsys)
    assert f"--data-path {prefix}: token id 60000 is beyond the tokenizer's vocabulary" in err


def test_seq_length_beyond_the_data_is_refused_up_front(
    gpt_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = _dataset(tmp_path, [[1, 2, 3] * 10])
    err = _fails(gpt_args({**gpt_data, "data": prefix}, **{"seq-length": 64}), capsys)
    assert "--seq-length 64 exceeds the data" in err and "30 tokens" in err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"train-iters": 0}, "--train-iters must be >= 1, got 0"),
        ({"lr-warmup-fraction": 1.5}, "--lr-warmup-fraction must be in [0, 1)"),
        ({"lr-warmup-fraction": 0.5, "lr-warmup-iters": 1}, "--lr-warmup-fraction and --lr-warmup-iters"),
        ({"lr-decay-style": "cosine", "lr-warmup-iters": 4}, "--lr-decay-iters 4 (default: --train-iters)"),
        ({"exit-interval": -1}, "--exit-interval must be >= 0"),
    ],
)
def test_flag_errors_name_the_flag(
    gpt_data: dict[str, str], capsys: pytest.CaptureFixture[str], flags: dict, needle: str
) -> None:
    assert needle in _fails(gpt_args(gpt_data, **flags), capsys)


def test_world_size_message_names_the_launch(
    gpt_data: dict[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    err = _fails(gpt_args(gpt_data, **{"tp": 2}), capsys)
    assert "--world-size" not in err and "3 process(es)" in err and "--tensor-model-parallel-size 2" in err


# ------------------------------------------------------------------------------------- feedback


def test_start_summary_and_no_bar_off_a_terminal(
    gpt_data: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a for a in gpt_args(gpt_data, **{"train-iters": 2}) if a != "--no-progress"]
    assert pretrain_main(argv) == 0
    out = capsys.readouterr()
    assert "starting gpt:" in out.out and "tp=1 pp=1 vp=1 dp=1" in out.out
    assert "global batch 8 x seq 32 = 256 tokens/iteration" in out.out
    assert "it/s" not in out.err and "train:" not in out.err  # no tqdm bar in a log file
    assert "iter      2 | loss" in out.out


def test_other_model_size_is_an_architecture_mismatch(
    gpt_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert pretrain_main(gpt_args(gpt_data, **{"train-iters": 1, "save": tmp_path / "ck"})) == 0
    err = _fails(gpt_args(gpt_data, **{"train-iters": 2, "load": tmp_path / "ck", "num-layers": 2}), capsys)
    assert "architecture differs" in err and "num-layers 4 (checkpoint) vs 2 (this run)" in err
    assert "reshard" not in err


@pytest.mark.slow
def test_under_torchrun_the_error_is_printed_once(gpt_data: dict[str, str], tmp_path: Path) -> None:
    from tests.distributed import torchrun

    (tmp_path / "file").write_text("x")
    proc = torchrun(2, "pretrain.training.cli", gpt_args(gpt_data, **{"save": tmp_path / "file" / "ck"}))
    assert proc.returncode != 0
    assert proc.stderr.count(f"error: --save {tmp_path / 'file' / 'ck'}:") == 1, proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr or "exit code 2" in proc.stderr or "exitcode: 2" in proc.stderr
