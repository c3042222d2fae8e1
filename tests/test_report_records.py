"""Records and the report (issue #25 item 9): mlm-finetune's own prediction files are not "skipped
results", its records carry the parameter count, an all-sample-data board says why nothing is
ranked, and a newer result that hides an older, different one of the same weights is marked."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from finetune.builtin import builtin_task_dir
from finetune.cli import main as finetune_main
from mlm_eval.cli import main as eval_main
from mlm_eval.report.cli import rich_tables
from mlm_eval.report.collect import collect_results
from mlm_eval.report.table import TableConfig, build_leaderboard
from mlm_eval.report.text import rank_header
from tests import report_fixtures as rf


def _report(results: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, dict]:
    capsys.readouterr()
    assert eval_main(["report", "--results", str(results), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    return captured.out + captured.err, json.loads((out / "leaderboard.json").read_text())


def test_finetune_outputs_are_ignored_quietly_and_params_recorded(
    tiny_bert_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a relative --results-dir, as a user types it
    assert finetune_main(["squad", "--hf-model", str(tiny_bert_dir), "--data-dir", str(builtin_task_dir("squad_tiny")),
                          "--seq-length", "48", "--doc-stride", "16", "--max-query-length", "16", "--global-batch-size",
                          "16", "--epochs", "0.3", "--lr", "1e-3", "--results-dir", "res", "--no-progress"]) == 0  # fmt: skip
    assert (tmp_path / "res" / "predictions.json").is_file() and (
        tmp_path / "res" / "nbest_predictions.json"
    ).is_file()
    text, doc = _report(tmp_path / "res", tmp_path / "report", capsys)
    assert "skipped" not in text.lower() and doc["skipped"] == []
    assert any(n.startswith("Ignored 2 output file(s)") for n in doc["notes"])
    (row,) = doc["rows"]
    assert row["name"] == tiny_bert_dir.name and isinstance(row["parameters"], int) and row["parameters"] > 0
    # a file the record does not name is still reported
    (tmp_path / "res" / "stray.json").write_text("{}")
    text, doc = _report(tmp_path / "res", tmp_path / "report", capsys)
    assert [Path(s["path"]).name for s in doc["skipped"]] == ["stray.json"] and "warning: skipped" in text


def test_all_sample_data_says_why_nothing_is_ranked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rf.write_demo(tmp_path / "results")
    coll = collect_results([tmp_path / "results"])
    board = build_leaderboard(coll.records, TableConfig(), coll.hygiene)
    assert all(r.rank is None for r in board.rows) and rank_header(board) == "# (unranked: sample data)"
    _report(tmp_path / "results", tmp_path / "out", capsys)
    md = (tmp_path / "out" / "leaderboard.md").read_text()
    assert "| # (unranked: sample data) | Model |" in md
    assert (
        '>#<span class="why">(unranked: sample data)</span></th>'
        in (tmp_path / "out" / "leaderboard.html").read_text()
    )
    # with a ranked row the header is the plain '#'
    rf.result(tmp_path / "results" / "real.json", name="real", task="wikitext103", fingerprint=rf.GPT345,
              metrics={"adjusted_ppl": 20.0}, created="2024-04-01T00:00:00Z")  # fmt: skip
    coll = collect_results([tmp_path / "results"])
    assert rank_header(build_leaderboard(coll.records, TableConfig(), coll.hygiene)) == "#"


def test_an_older_different_result_of_the_same_weights_is_marked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "results"
    common = dict(name="m", task="lambada", fingerprint=rf.GPT345, layout="tp1-pp1-vp1")
    old = rf.result(root / "old.json", metrics={"accuracy": 0.40}, created="2024-01-01T00:00:00Z", **common)
    rf.result(root / "new.json", metrics={"accuracy": 0.45}, created="2024-02-01T00:00:00Z", **common)
    # the same value in another layout (fp32 rounding below the printed precision) is no conflict
    rf.result(root / "other.json", name="m", task="wikitext103", fingerprint=rf.GPT345, layout="tp2-pp1-vp1",
              metrics={"adjusted_ppl": 20.000001}, created="2024-01-01T00:00:00Z")  # fmt: skip
    rf.result(root / "other2.json", name="m", task="wikitext103", fingerprint=rf.GPT345, layout="tp1-pp1-vp1",
              metrics={"adjusted_ppl": 20.0}, created="2024-02-01T00:00:00Z")  # fmt: skip
    coll = collect_results([root])
    board = build_leaderboard(coll.records, TableConfig(), coll.hygiene)
    (row,) = board.rows
    assert row.cells["lambada:accuracy"].value == pytest.approx(45.0)
    assert row.cells["lambada:accuracy"].older == ((str(old), pytest.approx(40.0)),)
    assert "older differs" in row.cells["lambada:accuracy"].marks()
    assert row.cells["wikitext103:adjusted_ppl"].older == ()
    text, doc = _report(root, tmp_path / "out", capsys)
    note = next(n for n in doc["notes"] if n.startswith("Conflicting results for m, LAMBADA"))
    assert "45.00" in note and f"40.00 ({old})" in note and "Conflicting" in text
    html = (tmp_path / "out" / "leaderboard.html").read_text()
    assert '<span class="mark older">older differs</span>' in html and "Conflicting results for m" in html
    table_text = "".join(str(c) for t in rich_tables(board, 200) for col in t.columns for c in col._cells)
    assert "older differs" in table_text
    assert re.search(r"older differs", (tmp_path / "out" / "leaderboard.md").read_text())
