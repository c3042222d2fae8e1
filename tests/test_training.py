"""The training loop end to end: parallel layouts equal one process, exact resume, crash-safe saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain.training.cli import main as pretrain_main
from tests.distributed import launch
from tests.train_fixtures import gpt_args

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(gpt_data: dict[str, str]) -> dict[str, str]:
    return gpt_data


def _losses(path: Path) -> list[float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _torchrun(nproc: int, flags: list[str]) -> subprocess.CompletedProcess[str]:
    return launch(nproc, "pretrain.training.cli", flags)


@pytest.mark.slow
def test_world8_tp2_pp2_dp2_losses_equal_single_process(data: dict[str, str], tmp_path: Path) -> None:
    assert pretrain_main(gpt_args(data, **{"log-json": tmp_path / "one.jsonl"})) == 0
    single = _losses(tmp_path / "one.jsonl")
    flags = gpt_args(data, **{"log-json": tmp_path / "eight.jsonl", "tp": 2, "pp": 2, "micro-batch-size": 1,
                              "use-distributed-optimizer": True})  # fmt: skip
    proc = _torchrun(8, flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    eight = _losses(tmp_path / "eight.jsonl")
    assert len(single) == len(eight) == 4
    assert single[0] > single[-1]  # it learns
    torch.testing.assert_close(torch.tensor(eight), torch.tensor(single), rtol=1e-5, atol=1e-6)


def test_resume_reproduces_losses_bitwise(data: dict[str, str], tmp_path: Path) -> None:
    common = {"train-iters": 6, "hidden-dropout": 0.1, "attention-dropout": 0.1, "lr-decay-style": "cosine",
              "lr-warmup-iters": 2}  # fmt: skip
    full = gpt_args(data, **common, **{"log-json": tmp_path / "full.jsonl"})
    assert pretrain_main(full) == 0
    first = gpt_args(data, **{**common, "train-iters": 6, "save": tmp_path / "ck", "save-interval": 3,
                              "log-json": tmp_path / "a.jsonl"})  # fmt: skip
    # Interrupt after iteration 3 by running only 3 iterations of the same 6-iteration schedule.
    first[first.index("--train-iters") + 1] = "3"
    first[first.index("--lr-decay-iters") + 1 if "--lr-decay-iters" in first else len(first) :] = []
    assert pretrain_main(first + ["--lr-decay-iters", "6"]) == 0
    resumed = gpt_args(data, **common, **{"load": tmp_path / "ck", "log-json": tmp_path / "b.jsonl"})
    assert pretrain_main(resumed + ["--lr-decay-iters", "6"]) == 0
    a, b, ref = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "b.jsonl"), _losses(tmp_path / "full.jsonl")
    assert len(a) == 3 and len(b) == 3
    assert a + b == ref  # bitwise: same floats


@pytest.mark.slow
def test_layout_mismatch_names_both_layouts(
    data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert pretrain_main(gpt_args(data, **{"train-iters": 1, "save": tmp_path / "ck"})) == 0
    proc = _torchrun(2, gpt_args(data, **{"train-iters": 2, "load": tmp_path / "ck", "tp": 2}))
    assert proc.returncode != 0
    assert (
        "tp=1 pp=1 vp=1" in proc.stderr
        and "tp=2 pp=1 vp=1" in proc.stderr
        and "mlm-convert reshard" in proc.stderr
    )


KILLER = """
import os, signal, sys
import pretrain.checkpoint.legacy.io as io
from pretrain.training.cli import main
calls = {"n": 0}
real_save = io.stream_save  # what the rank file is written with
def save(obj, fh, *a, **k):
    calls["n"] += 1
    if calls["n"] == 2:  # the second checkpoint: die with a half-written file
        fh.write(b"partial")
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, fh, *a, **k)
io.stream_save = save
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
def test_kill_during_save_keeps_previous_checkpoint(data: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    flags = gpt_args(data, **{"train-iters": 4, "save": tmp_path / "ck", "save-interval": 2})
    proc = subprocess.run([sys.executable, str(script), *flags], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == -9
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (tmp_path / "ck" / "iter_0000004").exists()
    # The previous checkpoint loads and training resumes from it.
    resumed = gpt_args(data, **{"train-iters": 3, "load": tmp_path / "ck", "log-json": tmp_path / "r.jsonl"})
    assert pretrain_main(resumed) == 0
    assert len(_losses(tmp_path / "r.jsonl")) == 1


class Evil:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("echo pwned > /dev/null",))


def test_pickled_object_in_checkpoint_is_refused(
    data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert pretrain_main(gpt_args(data, **{"train-iters": 1, "save": tmp_path / "ck"})) == 0
    path = tmp_path / "ck" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=True)
    state["args"].evil = Evil()  # args: Megatron's Namespace
    torch.save(state, path)
    with pytest.raises(SystemExit) as exc:
        pretrain_main(gpt_args(data, **{"train-iters": 2, "load": tmp_path / "ck"}))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "cannot be loaded safely" in err and str(path) in err


@pytest.mark.slow
def test_bert_tp2_pp2_losses_equal_single_process(tmp_path: Path) -> None:
    from tests.train_fixtures import bert_args, make_bert_data

    bdata = make_bert_data(tmp_path / "data")
    assert pretrain_main(bert_args(bdata, **{"train-iters": 3, "log-json": tmp_path / "one.jsonl"})) == 0
    proc = _torchrun(4, bert_args(bdata, **{"train-iters": 3, "tp": 2, "pp": 2, "micro-batch-size": 1,
                                            "log-json": tmp_path / "four.jsonl"}))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, four = _losses(tmp_path / "one.jsonl"), _losses(tmp_path / "four.jsonl")
    assert len(one) == len(four) == 3
    torch.testing.assert_close(torch.tensor(four), torch.tensor(one), rtol=1e-5, atol=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert rows[0]["sop loss"] > 0 and rows[0]["lm loss"] > 0


def test_bf16_finetune_from_checkpoint_keeps_loaded_weights(data: dict[str, str], tmp_path: Path) -> None:
    # Loaded weights must reach the fp32 main parameters: with lr 0 the second iteration still uses them.
    assert pretrain_main(gpt_args(data, **{"train-iters": 20, "lr": 3e-3, "save": tmp_path / "ck"})) == 0
    runs = {}
    for name, extra in (("fp32", {}), ("bf16", {"bf16": True})):
        flags = gpt_args(data, **{"train-iters": 2, "lr": 0.0, "min-lr": 0.0, "load": tmp_path / "ck", "finetune": True,
                                  "log-json": tmp_path / f"{name}.jsonl", **extra})  # fmt: skip
        assert pretrain_main(flags) == 0
        runs[name] = _losses(tmp_path / f"{name}.jsonl")
    fresh = gpt_args(
        data, **{"train-iters": 2, "lr": 0.0, "min-lr": 0.0, "log-json": tmp_path / "fresh.jsonl"}
    )
    assert pretrain_main(fresh) == 0
    untrained = _losses(tmp_path / "fresh.jsonl")
    assert runs["fp32"][1] < untrained[1] - 0.3  # the checkpoint is clearly better than the init
    assert abs(runs["bf16"][1] - runs["fp32"][1]) < 0.05 * runs["fp32"][1]
