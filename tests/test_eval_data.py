"""mlm-eval data sources (raw files, datasets JSON/parquet/save_to_disk), --limit and result details."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import pytest

from mlm_eval.builtin import builtin_path
from mlm_eval.cli import main

WIKI_ARGS = ["--seq-length", "48", "--overlap", "16", "--no-progress"]


@pytest.fixture(scope="module")
def tiny(tiny_gpt2_dir: Path) -> Path:
    return tiny_gpt2_dir


def _hf_wikitext_rows() -> list[str]:
    """The sample file's lines as the Hugging Face ``wikitext`` dataset stores them (blank line = "")."""
    lines = builtin_path("wikitext_sample.tokens").read_text(encoding="utf-8").splitlines(keepends=True)
    return ["" if not line.strip() else line for line in lines]


def _lambada_texts() -> list[str]:
    return [json.loads(x)["text"] for x in builtin_path("lambada_sample.jsonl").read_text().splitlines()]


def _run(tiny: Path, tmp: Path, name: str, argv: list[str]) -> dict[str, Any]:
    out = tmp / f"{name}.json"
    assert main([*argv, "--hf-model", str(tiny), "--out", str(out)]) == 0
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def _datasets_files(tmp: Path, column: str, rows: list[str]) -> dict[str, str]:
    import datasets

    ds = datasets.Dataset.from_dict({column: rows, "id": list(range(len(rows)))})
    ds.to_json(tmp / f"{column}.jsonl")
    ds.to_parquet(tmp / f"{column}.parquet")
    datasets.DatasetDict({"test": ds, "train": ds.select(range(3))}).save_to_disk(tmp / f"{column}_dir")
    return {"jsonl": str(tmp / f"{column}.jsonl"), "parquet": str(tmp / f"{column}.parquet"),
            "dir": str(tmp / f"{column}_dir")}  # fmt: skip


@pytest.mark.slow  # > 10 s
def test_wikitext_from_datasets_equals_raw_file(tiny: Path, tmp_path: Path) -> None:
    raw = _run(tiny, tmp_path, "raw", ["wikitext103", "--data", "builtin:wikitext_sample.tokens", *WIKI_ARGS])
    files = _datasets_files(tmp_path, "text", _hf_wikitext_rows())
    for kind, path in files.items():
        got = _run(tiny, tmp_path, kind, ["wikitext103", "--data", path, *WIKI_ARGS])
        assert got["metrics"] == raw["metrics"], kind
        # the rows join back into exactly the raw file: same content hash as the file's bytes
        assert got["details"]["data_sha256"] == raw["details"]["data_sha256"], kind


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
def test_lambada_from_datasets_equals_jsonl(tiny: Path, tmp_path: Path) -> None:
    raw = _run(tiny, tmp_path, "raw", ["lambada", "--data", "builtin:lambada_sample.jsonl", "--no-progress"])
    files = _datasets_files(tmp_path, "sentence", _lambada_texts())
    for kind in ("parquet", "dir"):
        got = _run(tiny, tmp_path, kind, ["lambada", "--data", files[kind], "--text-column", "sentence",
                                          "--no-progress"])  # fmt: skip
        assert got["metrics"] == raw["metrics"], kind
        assert got["details"]["data"] == files[kind]


def test_limit_and_details(tiny: Path, tmp_path: Path) -> None:
    head = tmp_path / "head.jsonl"
    head.write_text("".join(json.dumps({"text": t}) + "\n" for t in _lambada_texts()[:7]))
    first7 = _run(tiny, tmp_path, "first7", ["lambada", "--data", str(head), "--no-progress"])
    limited = _run(tiny, tmp_path, "lim", ["lambada", "--data", "builtin:lambada_sample.jsonl", "--limit", "7",
                                           "--no-progress"])  # fmt: skip
    assert limited["metrics"] == first7["metrics"] and limited["metrics"]["count"] == 7
    details = limited["details"]
    assert details["limit"] == 7 and first7["details"]["limit"] is None
    assert details["dtype"] == "float32" and details["layout"] == "tp1-pp1-dp1"
    assert details["toolkit_version"] == importlib.metadata.version("mlm-toolkit")
    assert details["elapsed_s"] >= 0 and len(details["data_sha256"]) == 64

    full = _run(
        tiny, tmp_path, "full", ["wikitext103", "--data", "builtin:wikitext_sample.tokens", *WIKI_ARGS]
    )
    m = full["metrics"]
    three = _run(tiny, tmp_path, "three", ["wikitext103", "--data", "builtin:wikitext_sample.tokens", *WIKI_ARGS,
                                           "--limit", "3"])["metrics"]  # fmt: skip
    assert three["windows"] == 3 and three["planned_windows"] == m["windows"] > 3
    assert three["scored_targets"] == 48 + 2 * 16  # the first window's 48 targets, then 16 per window
    assert three["adjusted_ppl"] / three["token_ppl"] != 1.0
    all_ = _run(tiny, tmp_path, "all", ["wikitext103", "--data", "builtin:wikitext_sample.tokens", *WIKI_ARGS,
                                        "--limit", str(m["windows"] + 5)])["metrics"]  # fmt: skip
    assert all_ == m  # a limit past the end changes nothing
    docs = _run(tiny, tmp_path, "docs", ["wikitext103", "--data", "builtin:wikitext_sample.tokens", *WIKI_ARGS,
                                         "--method", "lm-eval", "--limit", "1"])["metrics"]  # fmt: skip
    assert docs["documents"] == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "builtin:lambada_sample.jsonl", "--dataset", "x"], "exactly one of --data"),
        ([], "exactly one of --data"),
        (["--data", "{dir}", "--split", "validation"], "no split 'validation'"),
        (["--data", "{parquet}"], "no column 'text'"),
        (["--data", "builtin:lambada_sample.jsonl", "--limit", "0"], "--limit must be >= 1"),
        (["--dataset", "surely_not_cached_dataset_xyz"], "cannot load the dataset"),
    ],
)
def test_data_errors(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    files = _datasets_files(tmp_path, "sentence", _lambada_texts())
    argv = [a.format(**files) for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(["lambada", *argv, "--hf-model", str(tiny), "--no-progress", "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2 and message in capsys.readouterr().err
