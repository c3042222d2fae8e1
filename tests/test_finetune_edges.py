"""mlm-finetune at its edges: outputs checked first, no silent overwrite, --eval-only uses the run's
own settings, flags named in their errors, non-UTF-8 input in one line, records declare units."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from finetune.builtin import builtin_task_dir
from finetune.cli import main
from tests.cli_helpers import one_line_error

SST2 = ["sst2", "--data-dir", str(builtin_task_dir("sst2_tiny")), "--no-progress", "--hidden-dropout", "0",
        "--attention-dropout", "0"]  # fmt: skip


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    return one_line_error(main, argv, capsys)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
        (["--epochs", "0"], "--epochs must be > 0, got 0"),
        (["--seeds", "0"], "--seeds must be >= 1, got 0"),
        (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction must be in [0, 1), got 1.5"),
    ],
)
def test_flag_errors_name_their_flag(
    tiny_bert_dir: Path, capsys: pytest.CaptureFixture[str], flags: list[str], needle: str
) -> None:
    assert needle in _fails([*SST2, "--hf-model", str(tiny_bert_dir), *flags], capsys)


def test_unwritable_outputs_are_refused_first(
    tiny_bert_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("x")
    for flag in ("--save", "--results-dir"):
        err = _fails([*SST2, "--hf-model", str(tiny_bert_dir), flag, str(tmp_path / "file" / "x")], capsys)
        assert err.startswith(f"error: {flag} {tmp_path / 'file' / 'x'}:")


def test_save_overwrite_eval_only_and_record(
    tiny_bert_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = ["--seq-length", "32", "--global-batch-size", "8", "--epochs", "0.08", "--lr", "1e-3"]
    save = ["--hf-model", str(tiny_bert_dir), *run, "--save", str(tmp_path / "ft")]
    assert main([*SST2, *save, "--results-dir", str(tmp_path / "a")]) == 0
    err = _fails([*SST2, *save], capsys)
    assert "already holds a finetuned checkpoint" in err and "--overwrite" in err
    # --eval-only needs none of the run's flags again and records the run's hyperparameters
    capsys.readouterr()
    assert (
        main([*SST2, "--eval-only", "--ckpt", str(tmp_path / "ft"), "--results-dir", str(tmp_path / "b")])
        == 0
    )
    captured = capsys.readouterr()
    assert "0it" not in captured.err + captured.out and "starting" not in captured.out
    a = json.loads((tmp_path / "a" / "results.json").read_text())
    b = json.loads((tmp_path / "b" / "results.json").read_text())
    assert b["metrics"] == a["metrics"]
    hyper = b["details"]["hyperparameters"]
    assert hyper["seq_length"] == 32 and hyper["global_batch_size"] == 8 and hyper["lr"] == 1e-3
    assert a["units"] == {"accuracy": "percent"} and a["sample_data"] is True and a["dtype"] == "float32"
    # the re-evaluation is the same model's row: its name, weights fingerprint and parameter count
    assert a["model"]["name"] == tiny_bert_dir.name and a["model"]["fingerprint"].startswith("w2:")
    assert {k: b["model"][k] for k in ("name", "fingerprint", "parameters")} == {
        k: a["model"][k] for k in ("name", "fingerprint", "parameters")
    }
    assert a["model"]["parameters"] == _hf_parameters(tiny_bert_dir, num_labels=2)
    assert main([*SST2, *save, "--overwrite"]) == 0


def _hf_parameters(hf_dir: Path, *, num_labels: int) -> int:
    """transformers' count of ``BertForSequenceClassification`` over ``hf_dir``'s config."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig.from_pretrained(hf_dir, num_labels=num_labels)
    return int(BertForSequenceClassification(config).num_parameters())


def test_non_utf8_tsv_is_one_line(
    tiny_bert_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "SST-2"
    shutil.copytree(builtin_task_dir("sst2_tiny"), data)
    train = data / "train.tsv"
    lines = train.read_bytes().split(b"\n")
    lines[3] = lines[3].replace(b"the", b"th\xe9", 1) if b"the" in lines[3] else lines[3] + b"\xff"
    train.write_bytes(b"\n".join(lines))
    argv = ["sst2", "--data-dir", str(data), "--hf-model", str(tiny_bert_dir), "--seq-length", "32"]
    err = _fails(argv, capsys)
    assert f"{train}: line 4:" in err and "not UTF-8" in err


def test_data_dir_names_a_built_in_data_set(tiny_bert_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--data-dir builtin:NAME`` is the packaged directory (how tools/demo.py names it without importing
    finetune); an unknown name is one line naming the flag."""
    err = _fails(["sst2", "--data-dir", "builtin:nope", "--hf-model", str(tiny_bert_dir)], capsys)
    assert (
        err
        == "error: --data-dir builtin:nope: no such built-in data set (one of sst2_tiny, squad_tiny, squad2_tiny, race_tiny)"
    )
    # the built-in directory passes the task-file check: the next error is about the model, not the data
    err = _fails(["sst2", "--data-dir", "builtin:sst2_tiny", "--hf-model", "nowhere"], capsys)
    assert "--data-dir" not in err and "nowhere" in err
