"""mlm-eval at its edges: outputs checked before work, --limit runs kept apart and marked, the
record's declared units and marks, non-causal models and missing devices refused in one line."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from mlm_eval.cli import main
from pretrain.utils.results import make_result, normalized
from tests.cli_helpers import help_output_and_heavy_imports, one_line_error, truncated_weights_copy
from tests.finetune_fixtures import make_tiny_hf_bert

WIKI = ["wikitext103", "--data", "builtin:wikitext_sample.tokens", "--seq-length", "32", "--no-progress"]
LAMBADA = ["lambada", "--data", "builtin:lambada_sample.jsonl", "--no-progress"]


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    return one_line_error(main, argv, capsys)


@pytest.mark.parametrize("where", ["out-is-a-dir", "out-under-a-file", "results-dir-is-a-file"])
def test_unwritable_output_is_refused_before_scoring(
    tiny_gpt2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    flags = {
        "out-is-a-dir": ["--out", str(tmp_path / "dir")],
        "out-under-a-file": ["--out", str(tmp_path / "file" / "r.json")],
        "results-dir-is-a-file": ["--results-dir", str(tmp_path / "file")],
    }[where]
    err = _fails([*WIKI, "--hf-model", str(tiny_gpt2_dir), *flags], capsys)
    assert flags[0] in err


def test_limit_runs_get_their_own_file_and_never_replace_a_full_run(
    tiny_gpt2_dir_160: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    res = ["--hf-model", str(tiny_gpt2_dir_160), "--results-dir", str(tmp_path)]
    assert main([*LAMBADA, *res]) == 0
    assert main([*LAMBADA, *res, "--limit", "5"]) == 0
    full = json.loads((tmp_path / f"lambada-paper-{tiny_gpt2_dir_160.name}.json").read_text())
    part = json.loads((tmp_path / f"lambada-paper-{tiny_gpt2_dir_160.name}-limit5.json").read_text())
    assert full["partial"] is False and full["limit"] is None and full["metrics"]["count"] > 5
    assert part["partial"] is True and part["limit"] == 5 and part["metrics"]["count"] == 5
    out = capsys.readouterr().out
    assert "PARTIAL: first 5 only" in out and "SAMPLE data" in out
    err = _fails([*LAMBADA, *res, "--limit", "5", "--out", str(tmp_path / f"lambada-paper-{tiny_gpt2_dir_160.name}.json")],
                 capsys)  # fmt: skip
    assert "full (not --limit) result" in err


def test_records_declare_units_dtype_and_sample_data(
    tiny_gpt2_dir_160: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    assert main([*LAMBADA, "--hf-model", str(tiny_gpt2_dir_160), "--out", str(out), "--dtype", "bf16"]) == 0
    record = json.loads(out.read_text())
    assert record["units"] == {"accuracy": "fraction"} and 0.0 <= record["metrics"]["accuracy"] <= 1.0
    assert record["dtype"] == "bfloat16" and record["sample_data"] is True and record["partial"] is False
    assert "bfloat16 weights" in capsys.readouterr().out


def test_old_records_read_with_defaults() -> None:
    old = make_result(kind="eval", task="lambada", method="paper", model={"name": "m"}, metrics={"accuracy": 0.5},
                      details={"limit": 7, "dtype": "float16", "data": "builtin:lambada_sample.jsonl"})  # fmt: skip
    for key in ("units", "partial", "limit", "dtype", "sample_data"):
        del old[key]
    new = normalized(old)
    assert new["partial"] is True and new["limit"] == 7 and new["dtype"] == "float16" and new["sample_data"]
    assert new["units"] is None  # unknown: the reader uses the producer's documented scale


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_result_json_follows_the_umask(tiny_gpt2_dir: Path, tmp_path: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        assert main([*WIKI, "--hf-model", str(tiny_gpt2_dir), "--out", str(tmp_path / "new" / "r.json")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new" / "r.json").stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o777 & ~mask


def test_bert_is_refused_as_a_causal_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bert = make_tiny_hf_bert(tmp_path / "bert", ["the movie was good", "a bad movie"])
    capsys.readouterr()
    err = _fails([*WIKI, "--hf-model", str(bert), "--out", str(tmp_path / "r.json")], capsys)
    assert "bert model attends in both directions" in err and not (tmp_path / "r.json").exists()


def test_truncated_safetensors_is_one_line(
    tiny_gpt2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken, _ = truncated_weights_copy(tiny_gpt2_dir, tmp_path / "broken")
    err = _fails([*WIKI, "--hf-model", str(broken), "--out", str(tmp_path / "r.json")], capsys)
    assert f"--hf-model {broken}" in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_one_line(
    tiny_gpt2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _fails(
        [*WIKI, "--hf-model", str(tiny_gpt2_dir), "--device", "cuda", "--out", str(tmp_path / "r")], capsys
    )
    assert "--device cuda: CUDA is not available" in err


def test_contamination_speaks_the_common_vocabulary(tmp_path: Path) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"text": "nothing to see here at all today"}) + "\n")
    argv = ["contamination", "--train", str(train), "--eval", "lambada", "--data", "builtin:lambada_sample.jsonl",
            "--results-dir", str(tmp_path / "res"), "--no-progress", "--name", "m"]  # fmt: skip
    assert main(argv) == 0
    (path,) = (tmp_path / "res").glob("contamination-*.json")
    record = json.loads(path.read_text())
    assert record["sample_data"] is True and record["units"]["share"] == "fraction"


def test_top_level_help_imports_no_heavy_library() -> None:
    out, heavy = help_output_and_heavy_imports("mlm_eval.cli", ("torch", "transformers", "datasets", "rich"))
    assert "wikitext103" in out and heavy == []


def test_report_out_that_is_a_file_is_refused_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "res").mkdir()
    (tmp_path / "file").write_text("x")
    err = _fails(["report", "--results", str(tmp_path / "res"), "--out", str(tmp_path / "file")], capsys)
    assert err.startswith(f"error: --out {tmp_path / 'file'}: is a file")


def test_torchrun_ranks_report_the_same_error_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pretrain.utils.errors import first_report

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    __import__("tempfile").tempdir = None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"test-{os.getpid()}")
    monkeypatch.setenv("WORLD_SIZE", "4")
    try:
        assert [first_report("--save x: bad") for _ in range(4)] == [True, False, False, False]
        assert first_report("another message") is True
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
        assert first_report("--save x: bad") is True  # outside torchrun: always printed
    finally:
        __import__("tempfile").tempdir = None
