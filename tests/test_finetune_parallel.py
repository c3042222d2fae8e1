"""Finetuning under tensor and pipeline parallelism equals one process (dropout off)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from finetune.builtin import builtin_task_dir
from finetune.cli import main
from tests.distributed import launch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bert(tiny_bert_dir: Path) -> Path:
    return tiny_bert_dir


def _flags(bert: Path, tmp: Path, name: str) -> list[str]:
    return ["sst2", "--hf-model", str(bert), "--data-dir", str(builtin_task_dir("sst2_tiny")), "--seq-length", "32",
            "--global-batch-size", "8", "--micro-batch-size", "4", "--epochs", "0.16", "--lr", "1e-3",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--no-progress", "--log-json", str(tmp / f"{name}.jsonl"),
            "--results-dir", str(tmp / name)]  # fmt: skip


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if '"loss"' in line]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2"]])
def test_two_ranks_equal_one_process(bert: Path, tmp_path: Path, layout: list[str]) -> None:
    torch.set_num_threads(1)
    assert main(_flags(bert, tmp_path, "one")) == 0
    proc = launch(2, "finetune.cli", [*_flags(bert, tmp_path, "two"), *layout], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = _losses(tmp_path / "one.jsonl"), _losses(tmp_path / "two.jsonl")
    assert len(one) == len(two) == 4
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=1e-6)
    res_one = json.loads((tmp_path / "one" / "results.json").read_text())["metrics"]
    res_two = json.loads((tmp_path / "two" / "results.json").read_text())["metrics"]
    assert res_one == res_two
    assert (tmp_path / "one" / "SST-2-dev-predictions.tsv").read_text() == (
        tmp_path / "two" / "SST-2-dev-predictions.tsv"
    ).read_text()
