"""mlm-finetune end to end on tiny official-format files with a tiny random BERT and WordPiece.

Every task family: parsing, a few training steps through the engine, evaluation with the
official metrics, prediction files; ``--save`` then ``--eval-only`` reproduces the metrics; bad
input exits with code 2 and one line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from finetune.builtin import builtin_task_dir
from finetune.cli import main
from finetune.presets import get_preset
from pretrain.utils.results import RESULT_SCHEMA, TASK_METRICS
from tests.finetune_fixtures import FINETUNE_WORDS as WORDS
from tests.finetune_fixtures import make_tiny_hf_bert


@pytest.fixture(scope="module", autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def bert(tiny_bert_dir: Path) -> Path:
    return tiny_bert_dir


def _run(argv: list[str]) -> dict:
    assert main([*argv, "--no-progress", "--hidden-dropout", "0", "--attention-dropout", "0"]) == 0
    out = Path(argv[argv.index("--results-dir") + 1])
    return json.loads((out / "results.json").read_text())


def _check_record(record: dict, task: str) -> None:
    assert record["schema"] == RESULT_SCHEMA and record["kind"] == "finetune" and record["task"] == task
    assert set(record["metrics"]) == set(TASK_METRICS[task])
    assert all(math.isfinite(v) for v in record["metrics"].values())
    run = record["details"]["runs"][0]
    assert run["iterations"] > 0 and math.isfinite(run["final_loss"])


def test_sst2_trains_writes_predictions_and_eval_only_reproduces(bert: Path, tmp_path: Path) -> None:
    data = builtin_task_dir("sst2_tiny")
    common = ["--data-dir", str(data), "--seq-length", "32", "--global-batch-size", "8"]
    rec = _run(["sst2", "--hf-model", str(bert), *common, "--epochs", "0.2", "--lr", "1e-3",
                "--save", str(tmp_path / "ft"), "--results-dir", str(tmp_path / "res")])  # fmt: skip
    _check_record(rec, "sst2")
    assert rec["details"]["runs"][0]["iterations"] == 5  # ceil(0.2 * 200 / 8)
    preds = (tmp_path / "res" / "SST-2-dev-predictions.tsv").read_text().splitlines()
    assert (
        preds[0] == "index\tprediction"
        and len(preds) == 61
        and {p.split("\t")[1] for p in preds[1:]} <= {"0", "1"}
    )
    again = _run(
        [
            "sst2",
            "--eval-only",
            "--ckpt",
            str(tmp_path / "ft"),
            *common,
            "--results-dir",
            str(tmp_path / "ev"),
        ]
    )
    assert again["metrics"] == rec["metrics"] and again["details"]["runs"][0]["iterations"] == 0
    assert (tmp_path / "ev" / "SST-2-dev-predictions.tsv").read_text() == "\n".join(preds) + "\n"


def _mnli_dir(root: Path) -> Path:
    d = root / "MNLI"
    d.mkdir(parents=True)
    head = "\t".join(
        ["index", "promptID", "pairID", "genre", "b1", "b2", "p1", "p2", "sentence1", "sentence2"]
    )
    pairs = [("the movie was good", "the movie was great", "entailment"),
             ("the movie was good", "the movie was awful", "contradiction"),
             ("the movie was good", "the company is a museum", "neutral")]  # fmt: skip

    def row(i: int, s1: str, s2: str, *tail: str) -> str:
        return "\t".join([str(i), "0", "0", "g", "x", "x", "x", "x", s1, s2, *tail])

    train = [row(i, *pairs[i % 3][:2], pairs[i % 3][2], pairs[i % 3][2]) for i in range(24)]
    (d / "train.tsv").write_text("\n".join([head + "\tlabel1\tgold_label", *train]) + "\n")
    for k in ("matched", "mismatched"):
        dev = [row(i, *pairs[i % 3][:2], *[pairs[i % 3][2]] * 6) for i in range(6)]
        labels = "\t".join(["label1", "label2", "label3", "label4", "label5", "gold_label"])
        (d / f"dev_{k}.tsv").write_text("\n".join([head + "\t" + labels, *dev]) + "\n")
        (d / f"test_{k}.tsv").write_text(
            "\n".join([head, *[row(i, *pairs[i % 3][:2]) for i in range(5)]]) + "\n"
        )
    return root


def test_mnli_matched_mismatched_and_submission_files(bert: Path, tmp_path: Path) -> None:
    rec = _run(["mnli", "--hf-model", str(bert), "--data-dir", str(_mnli_dir(tmp_path / "glue")), "--seq-length", "24",
                "--global-batch-size", "8", "--micro-batch-size", "4", "--epochs", "1", "--lr", "1e-3",
                "--results-dir", str(tmp_path / "res")])  # fmt: skip
    _check_record(rec, "mnli")
    for name in ("MNLI-m.tsv", "MNLI-mm.tsv"):
        lines = (tmp_path / "res" / name).read_text().splitlines()
        assert len(lines) == 6 and all(
            x.split("\t")[1] in ("contradiction", "entailment", "neutral") for x in lines[1:]
        )
    assert rec["details"]["hyperparameters"]["preset"] == "336m"


def test_stsb_regression_two_seeds_report_the_median(bert: Path, tmp_path: Path) -> None:
    d = tmp_path / "STS-B"
    d.mkdir()
    head = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
    rows = [f"{i}\tg\tf\ty\t0\ts\ts\tthe movie was {WORDS[4 + i % 4]}\tthe movie was good" for i in range(16)]
    scored = [f"{r}\t{(i % 4) * 1.25:.2f}" for i, r in enumerate(rows)]
    (d / "train.tsv").write_text("\n".join([head + "\tscore", *scored]) + "\n")
    (d / "dev.tsv").write_text("\n".join([head + "\tscore", *scored[:8]]) + "\n")
    rec = _run(["stsb", "--hf-model", str(bert), "--data-dir", str(tmp_path), "--seq-length", "16", "--epochs", "1",
                "--global-batch-size", "8", "--seeds", "2", "--results-dir", str(tmp_path / "res")])  # fmt: skip
    _check_record(rec, "stsb")
    runs = rec["details"]["runs"]
    assert [r["seed"] for r in runs] == [1234, 1235] and rec["method"] == "median"
    for k, v in rec["metrics"].items():
        assert v == pytest.approx(sum(r["metrics"][k] for r in runs) / 2)  # median of two = mean
    assert (tmp_path / "res" / "seed_1" / "STS-B-dev-predictions.tsv").is_file()


@pytest.mark.parametrize("task,data", [("squad", "squad_tiny"), ("squad2", "squad2_tiny")])
def test_squad_windows_train_and_write_official_predictions(
    bert: Path, tmp_path: Path, task: str, data: str
) -> None:
    rec = _run([task, "--hf-model", str(bert), "--data-dir", str(builtin_task_dir(data)), "--seq-length", "48",
                "--doc-stride", "16", "--max-query-length", "16", "--global-batch-size", "16", "--epochs", "0.3",
                "--lr", "1e-3", "--results-dir", str(tmp_path / "res")])  # fmt: skip
    _check_record(rec, "squad1" if task == "squad" else "squad2")
    dev = json.loads((builtin_task_dir(data) / "dev.json").read_text())
    qids = {q["id"] for a in dev["data"] for p in a["paragraphs"] for q in p["qas"]}
    preds = json.loads((tmp_path / "res" / "predictions.json").read_text())
    assert set(preds) == qids and all(isinstance(v, str) for v in preds.values())
    assert set(json.loads((tmp_path / "res" / "nbest_predictions.json").read_text())) <= qids
    assert (tmp_path / "res" / "null_odds.json").is_file() == (task == "squad2")
    if task == "squad2":
        assert "HasAns_f1" in rec["details"]["runs"][0]["details"]


def test_race_multiple_choice_scores_subsets(bert: Path, tmp_path: Path) -> None:
    rec = _run(["race", "--hf-model", str(bert), "--data-dir", str(builtin_task_dir("race_tiny")), "--seq-length", "64",
                "--global-batch-size", "4", "--epochs", "0.2", "--results-dir", str(tmp_path / "res")])  # fmt: skip
    _check_record(rec, "race")
    details = rec["details"]["runs"][0]["details"]
    assert details["split"] == "test" and set(details["dev"]) == {
        "accuracy_middle",
        "accuracy_high",
        "accuracy",
    }
    letters = json.loads((tmp_path / "res" / "race-test-predictions.json").read_text())
    assert letters and set(letters.values()) <= set("ABCD")


def test_presets_are_table6() -> None:
    assert get_preset("qqp", "3.8b").global_batch_size == 256 and get_preset("qqp", "1.3b").lr == 3e-5
    assert get_preset("squad2", "1.3b").global_batch_size == 64 and get_preset("race", "1.3b").lr == 1e-5
    assert get_preset("mnli", "336m").epochs == 10 and get_preset("squad", "3.8b").lr == 1e-5


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--data-dir", "/nonexistent"], "--data-dir /nonexistent"),
        (["--data-dir", "DATA", "--seq-length", "1000"], "exceeds the model's 160 positions"),
        (["--data-dir", "DATA", "--tp", "2"], "--tp 2"),
        (["--data-dir", "DATA", "--global-batch-size", "6", "--micro-batch-size", "4"], "not divisible"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    bert: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = [str(builtin_task_dir("sst2_tiny")) if x == "DATA" else x for x in extra]
    with pytest.raises(SystemExit) as exc:
        main(["sst2", "--hf-model", str(bert), "--seq-length", "32", *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_usage_errors_exit_2(bert: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["sst2", "--data-dir", "x"], ["nope", "--hf-model", str(bert), "--data-dir", "x"],
                 ["sst2", "--ckpt", "a", "--hf-model", "b", "--data-dir", "x"]):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["sst2", "--eval-only", "--ckpt", str(tmp_path), "--data-dir", "x"])
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err


def test_starts_from_our_checkpoint_of_another_layout(tmp_path: Path) -> None:
    """A MegatronBERT pretraining checkpoint written at tp=2 pp=2 finetunes in one process."""
    from pretrain.checkpoint.legacy.writer import write_layout
    from pretrain.parallel.config import ParallelConfig
    from pretrain.tokenizer.loader import load_tokenizer_dir, save_tokenizer
    from tools.hf_io import import_hf

    texts = [
        line.split("\t")[0] for line in (builtin_task_dir("sst2_tiny") / "train.tsv").read_text().splitlines()
    ]
    hf = make_tiny_hf_bert(tmp_path / "hf", texts, megatron=True)
    write_layout(import_hf(hf, make_vocab_size_divisible_by=8), tmp_path / "ckpt", ParallelConfig(tp=2, pp=2))
    save_tokenizer(load_tokenizer_dir(hf), tmp_path / "ckpt" / "tokenizer")  # no record: found by directory
    common = ["--data-dir", str(builtin_task_dir("sst2_tiny")), "--seq-length", "32", "--global-batch-size", "8",
              "--epochs", "0.1"]  # fmt: skip
    from_ckpt = _run(
        ["sst2", "--ckpt", str(tmp_path / "ckpt"), *common, "--results-dir", str(tmp_path / "a")]
    )
    from_hf = _run(["sst2", "--hf-model", str(hf), *common, "--results-dir", str(tmp_path / "b")])
    _check_record(from_ckpt, "sst2")
    assert from_ckpt["model"]["checkpoint"] == str(tmp_path / "ckpt")
    runs = from_ckpt["details"]["runs"][0], from_hf["details"]["runs"][0]
    assert runs[0]["final_loss"] == pytest.approx(runs[1]["final_loss"], rel=1e-5)  # same weights either way
    assert from_ckpt["model"]["fingerprint"] == from_hf["model"]["fingerprint"]  # so one leaderboard row
