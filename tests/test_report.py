"""``mlm-eval report``: collection, reduction, ranking, best marks, references and the outputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlm_eval.cli import main as eval_main
from mlm_eval.paper_reference import PAPER_ROWS
from mlm_eval.report_collect import collect_results, is_percent_metric
from mlm_eval.report_table import (
    MISSING,
    Leaderboard,
    Row,
    SortKey,
    TableConfig,
    build_leaderboard,
    lower_is_better,
    parse_sort_key,
)
from pretrain.utils.errors import UserError
from pretrain.utils.results import make_result, write_result

WT = "wikitext103:adjusted_ppl"
LA = "lambada:accuracy"
MNLI_M = "mnli:accuracy_m"
MNLI_MM = "mnli:accuracy_mm"


def _result(
    path: Path,
    *,
    name: str,
    task: str,
    metrics: dict[str, float],
    created: str,
    params: int | None = None,
    iteration: int | None = None,
    kind: str = "eval",
    method: str = "paper",
    seed: int | None = None,
    layout: str | None = "tp1-pp1-vp1",
) -> None:
    record = make_result(
        kind=kind,
        task=task,
        method=method,
        model={"name": name, "parameters": params, "iteration": iteration, "layout": layout},
        metrics=metrics,
        seed=seed,
    )
    record["created"] = created
    write_result(path, record)


def write_fixtures(root: Path) -> None:
    """Several models, duplicates over seeds and times, an lm-eval-harness file, and bad files."""
    ev, ft = root / "eval", root / "finetune" / "mnli"
    ev.mkdir(parents=True)
    ft.mkdir(parents=True)
    m125, m350 = 125_000_000, 350_000_000
    # gpt-a at iteration 1000 was evaluated twice: the latest (28.0) must win over the older 30.0;
    # its LAMBADA accuracy is written as a fraction (shown as 40.00 percent). gpt-b has no LAMBADA
    # result: a missing cell. Columns: file, name, task, metrics, day, parameters, iteration.
    gpt_runs = [
        ("a1k_old", "gpt-a", "wikitext103", {"adjusted_ppl": 30.0}, 1, m125, 1000),
        ("a1k_new", "gpt-a", "wikitext103", {"adjusted_ppl": 28.0}, 2, m125, 1000),
        ("a1k_lambada", "gpt-a", "lambada", {"accuracy": 0.40, "count": 50, "correct": 20}, 2, m125, 1000),
        ("a2k", "gpt-a", "wikitext103", {"adjusted_ppl": 25.0}, 3, m125, 2000),
        ("a2k_lambada", "gpt-a", "lambada", {"accuracy": 45.5}, 3, m125, 2000),
        ("b2k", "gpt-b", "wikitext103", {"adjusted_ppl": 20.0}, 3, m350, 2000),
    ]
    for file, name, task, metrics, day, params, iteration in gpt_runs:
        created = f"2024-01-0{day}T00:00:00+00:00"
        _result(
            ev / f"{file}.json",
            name=name,
            task=task,
            metrics=metrics,
            created=created,
            params=params,
            iteration=iteration,
        )
    # bert-x MNLI over seeds; seed 1 was run twice (the older 70/70 run is superseded per seed).
    seed_runs = [
        (1, 70.0, 70.0, "2024-02-01"),
        (1, 80.0, 79.0, "2024-02-02"),
        (3, 81.0, 80.0, "2024-02-03"),
        (2, 84.0, 83.0, "2024-02-04"),
    ]
    for i, (seed, m, mm, date) in enumerate(seed_runs):
        _result(
            ft / f"bert_x_{i}.json",
            name="bert-x",
            task="mnli",
            kind="finetune",
            method="finetune",
            metrics={"accuracy_m": m, "accuracy_mm": mm},
            created=f"{date}T00:00:00Z",
            params=336_000_000,
            iteration=5000,
            seed=seed,
            layout=None,
        )
    _result(
        ft / "bert_y.json",
        name="bert-y",
        task="mnli",
        kind="finetune",
        method="finetune",
        metrics={"accuracy_m": 0.85, "accuracy_mm": 0.86},
        created="2024-02-05T00:00:00Z",
        params=1_300_000_000,
        iteration=5000,
        seed=1,
        layout=None,
    )
    harness = {
        "results": {
            "wikitext": {
                "alias": "wikitext",
                "word_perplexity,none": 37.37,
                "word_perplexity_stderr,none": "N/A",
                "byte_perplexity,none": 1.6,
                "bits_per_byte,none": 0.678,
            },
            "lambada_openai": {"acc,none": 0.3256, "acc_stderr,none": 0.0065, "perplexity,none": 40.05},
            "hellaswag": {"acc,none": 0.3},
        },
        "config": {
            "model": "hf",
            "model_args": "pretrained=gpt2,dtype=float32",
            "model_num_parameters": 124439808,
        },
        "date": 1700000000.0,
    }
    (root / "lm_eval_gpt2.json").write_text(json.dumps(harness))
    old_harness = {
        "results": {"lambada_openai": {"ppl": 20.5, "acc": 0.5, "acc_stderr": 0.01}},
        "versions": {"lambada_openai": 0},
        "config": {"model_args": "pretrained=/ckpts/pythia-160m"},
    }
    (root / "lm_eval_old.json").write_text(json.dumps(old_harness))
    (root / "broken.json").write_text('{"schema": "mlm-toolkit/result/v1", ')
    (root / "foreign.json").write_text(json.dumps({"hello": "world"}))
    bad = make_result(
        kind="eval", task="lambada", method="paper", model={"name": "z"}, metrics={"accuracy": 1.0}
    )
    bad["metrics"]["accuracy"] = "high"
    (root / "bad_metric.json").write_text(json.dumps(bad))
    hygiene = make_result(
        kind="eval",
        task="contamination",
        method="lambada-13gram",
        model={"name": "owt"},
        metrics={"share": 0.01},
    )
    write_result(root / "contamination.json", hygiene)


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    write_fixtures(root)
    return root


def _board(root: Path, **kw: Any) -> Leaderboard:
    return build_leaderboard(collect_results([root]).records, TableConfig(**kw))


def _row(board: Leaderboard, name: str, iteration: int | None = None) -> Row:
    (row,) = [r for r in board.rows if r.name == name and (iteration is None or r.iteration == iteration)]
    return row


def _value(row: Row, key: str) -> float | None:
    return row.cells[key].value if key in row.cells else None


def test_collect_reads_both_formats_and_skips_bad_files_by_name(results_dir: Path) -> None:
    coll = collect_results([results_dir, results_dir / "eval"])  # overlapping dirs count once
    skipped = {s.path.name: s.reason for s in coll.skipped}
    assert set(skipped) == {"broken.json", "foreign.json", "bad_metric.json", "contamination.json"}
    assert "not a model result" in skipped["contamination.json"]
    assert "not valid JSON" in skipped["broken.json"]
    assert "metrics.accuracy" in skipped["bad_metric.json"]
    assert len(coll.records) == 6 + 5 + 2 + 1  # ours, bert, harness (2 tasks), old harness
    harness = [r for r in coll.records if r.source == "lm-eval-harness"]
    by_task = {(r.model.name, r.task): dict(r.metrics) for r in harness}
    assert by_task[("gpt2", "wikitext103")] == {
        "word_perplexity": 37.37,
        "byte_perplexity": 1.6,
        "bits_per_byte": 0.678,
    }
    assert by_task[("gpt2", "lambada")] == pytest.approx({"accuracy": 32.56, "ppl": 40.05})
    assert by_task[("pythia-160m", "lambada")] == pytest.approx({"accuracy": 50.0, "ppl": 20.5})
    assert {r.parameters for r in harness} == {124439808, None}


def test_latest_rule_ranking_best_marks_and_missing_cells(results_dir: Path) -> None:
    board = _board(results_dir, reduce="latest")
    assert board.sort_column.key == WT  # default: first task column with a run
    ranked = [(r.name, r.iteration, r.rank) for r in board.rows if r.rank is not None]
    assert ranked == [("gpt-b", 2000, 1), ("gpt-a", 2000, 2), ("gpt-a", 1000, 3)]  # lower ppl first
    a1k = _row(board, "gpt-a", 1000)
    assert _value(a1k, WT) == 28.0 and a1k.cells[WT].n_runs == 2  # latest of 30.0 / 28.0
    assert _value(a1k, LA) == pytest.approx(40.0)  # fraction -> percent
    assert _value(_row(board, "gpt-b"), LA) is None  # missing
    best = {(r.name, r.iteration, k) for r in board.rows for k, c in r.cells.items() if c.best}
    assert ("gpt-b", 2000, WT) in best  # lower is better
    assert ("gpt-a", 2000, LA) in best  # higher is better: 45.5 > 40.0
    assert ("gpt-a", 1000, WT) not in best
    bert_x = _row(board, "bert-x")
    assert (_value(bert_x, MNLI_M), _value(bert_x, MNLI_MM)) == (84.0, 83.0)  # the latest run (seed 2)
    assert bert_x.rank is None  # no WikiText value: unranked, after the ranked rows
    assert ("bert-y", 5000, MNLI_M) in best and _value(_row(board, "bert-y"), MNLI_M) == pytest.approx(85.0)
    # The harness computes a different quantity: its own columns, tagged with the method.
    labels = {c.key: c.label for c in board.columns}
    assert "wikitext103:word_perplexity@lm-eval-harness" in labels
    assert labels["wikitext103:word_perplexity@lm-eval-harness"].endswith("[lm-eval-harness]")
    assert labels[WT] == "WikiText-103 adj. ppl ↓"
    harness = "@lm-eval-harness"
    assert list(labels) == [
        WT,
        f"wikitext103:word_perplexity{harness}",  # known metrics in TASK_METRICS order, then by name
        f"wikitext103:bits_per_byte{harness}",
        f"wikitext103:byte_perplexity{harness}",
        LA,
        f"lambada:accuracy{harness}",
        f"lambada:ppl{harness}",
        MNLI_M,
        MNLI_MM,
    ]
    assert all(board.columns[i].lower_is_better for i in (0, 1, 2, 3, 6))
    # A column with a single run has no competition: nothing is marked.
    assert not _row(board, "gpt2").cells[f"wikitext103:word_perplexity{harness}"].best


def test_median_rule_is_over_seeds(results_dir: Path) -> None:
    board = _board(results_dir, reduce="median", sort_by=SortKey(task="mnli"))
    bert_x = _row(board, "bert-x")
    # Seeds 1 (latest run 80/79), 2 (84/83), 3 (81/80): medians 81 and 80, not over all 4 runs.
    assert (_value(bert_x, MNLI_M), _value(bert_x, MNLI_MM)) == (81.0, 80.0)
    assert bert_x.cells[MNLI_M].n_runs == 3 and set(bert_x.cells[MNLI_M].seeds) == {1, 2, 3}
    assert [r.name for r in board.rows if r.rank is not None] == ["bert-y", "bert-x"]
    assert "median over seeds" in board.rule


def test_sort_by_metric_and_bad_sort_keys(results_dir: Path) -> None:
    board = _board(results_dir, sort_by=parse_sort_key("lambada:accuracy"))
    assert [(r.name, r.iteration) for r in board.rows if r.rank] == [("gpt-a", 2000), ("gpt-a", 1000)]
    board = _board(results_dir, sort_by=parse_sort_key("lambada:accuracy@lm-eval-harness"))
    assert [r.name for r in board.rows if r.rank] == ["pythia-160m", "gpt2"]  # 50.0 > 32.56
    with pytest.raises(UserError, match="--sort-by 'squad2'.*available: wikitext103:adjusted_ppl"):
        _board(results_dir, sort_by=parse_sort_key("squad2"))
    for text in ("lambada:", "lambada@", ":accuracy"):
        with pytest.raises(UserError, match="--sort-by"):
            parse_sort_key(text)


def test_reference_rows_are_marked_unranked_and_never_best(results_dir: Path) -> None:
    board = _board(results_dir, with_paper=True)
    refs = [r for r in board.rows if r.reference]
    assert len(refs) == len(PAPER_ROWS) == 8
    assert board.rows[-len(refs) :] == tuple(refs)  # after all runs
    assert all(r.rank is None and not any(c.best for c in r.cells.values()) for r in refs)
    gpt83 = _row(board, "Megatron GPT-2 8.3B (paper, Table 3)")
    assert (_value(gpt83, WT), _value(gpt83, LA)) == (10.81, 66.51)
    assert refs[0] is gpt83  # references sorted by the sort column too (lowest ppl first)
    assert _row(board, "gpt-b").cells[WT].best  # 10.81 is a reference, not a run
    bert39 = _row(board, "Megatron BERT 3.9B (paper, Table 5)")
    assert (_value(bert39, MNLI_M), _value(bert39, MNLI_MM)) == (91.4, 91.4)
    assert (_value(bert39, "race:accuracy"), _value(bert39, "race:accuracy_middle")) == (89.5, 91.8)
    ens = _row(board, "Megatron BERT 3.9B ensemble (5-way) (paper, Table 5)")
    assert "ensemble" in ens.note and _value(ens, MNLI_M) is None and _value(ens, "squad1:f1") == 95.8
    assert _value(_row(board, "Previous SOTA (paper, Table 3)"), WT) == 15.79


def test_metric_direction_and_scale_rules() -> None:
    assert lower_is_better("wikitext103", "adjusted_ppl") and lower_is_better("wikitext103", "bits_per_byte")
    assert lower_is_better("lambada", "ppl") and not lower_is_better("lambada", "accuracy")
    assert lower_is_better("newtask", "byte_perplexity") and not lower_is_better("newtask", "score")
    assert is_percent_metric("accuracy_mm") and is_percent_metric("exact_match") and is_percent_metric("f1")
    assert not is_percent_metric("adjusted_ppl") and not is_percent_metric("bits_per_byte")


def test_cli_writes_all_outputs_and_warns_per_bad_file(
    results_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    rc = eval_main(
        ["report", "--results", str(results_dir), "--out", str(out), "--with-paper", "--reduce", "median"]
    )
    assert rc == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning: skipped")]
    assert len(warnings) == 4 and all(results_dir.name in w for w in warnings)
    assert sorted(Path(w.split()[2].rstrip(":")).name for w in warnings) == [
        "bad_metric.json",
        "broken.json",
        "contamination.json",
        "foreign.json",
    ]
    assert "Leaderboard" in captured.out and str(out / "leaderboard.html") in captured.out.replace("\n", "")
    assert sorted(p.name for p in out.iterdir()) == [
        "leaderboard.csv",
        "leaderboard.html",
        "leaderboard.json",
        "leaderboard.md",
    ]

    doc = json.loads((out / "leaderboard.json").read_text())
    assert doc["schema"] == "mlm-toolkit/leaderboard/v1" and doc["reduce"]["rule"] == "median"
    assert "median over seeds" in doc["reduce"]["description"]
    gpt_b = next(r for r in doc["rows"] if r["name"] == "gpt-b")
    assert gpt_b["rank"] == 1 and gpt_b["cells"][WT] == {
        "value": 20.0,
        "best": True,
        "n_runs": 1,
        "seeds": [None],
        "sources": [str(results_dir / "eval/b2k.json")],
    }
    assert {s["path"].rsplit("/", 1)[-1] for s in doc["skipped"]} == {
        "bad_metric.json",
        "broken.json",
        "contamination.json",
        "foreign.json",
    }

    md = (out / "leaderboard.md").read_text()
    b_line = next(line for line in md.splitlines() if "| gpt-b |" in line)
    assert b_line.startswith("| 1 | gpt-b | 350M | 2000 | tp1-pp1-vp1 | **20.00** |") and MISSING in b_line
    assert "| ref | Megatron GPT-2 8.3B (paper, Table 3) | 8.3B | 300000 |" in md
    assert "median over seeds" in md and "references, not runs" in md and "Skipped " in md

    csv_lines = (out / "leaderboard.csv").read_text().splitlines()
    assert csv_lines[0].startswith("rank,reference,name,parameters,iteration,layout,WikiText-103 adj. ppl ↓")
    assert any(line.startswith("1,False,gpt-b,350000000,2000,tp1-pp1-vp1,20,") for line in csv_lines)

    # The report's own output inside a results dir is not reported as a foreign file.
    rc = eval_main(["report", "--results", str(tmp_path), "--out", str(out)])
    assert rc == 0 and "leaderboard.json" not in capsys.readouterr().err


def test_no_valid_results_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "foreign.json").write_text("[1, 2]")
    with pytest.raises(SystemExit) as exc:
        eval_main(["report", "--results", str(empty), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: --results {empty}: no valid result file found" in err and "foreign.json" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        eval_main(["report", "--results", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    assert "nope: not a directory" in capsys.readouterr().err


def test_metric_scale_override_and_harness_without_leaderboard_tasks(tmp_path: Path) -> None:
    # A tiny model's SQuAD EM of 0.5 percent stays 0.5 when the record says so; F1 0.9 without
    # the hint is read as a fraction (all accuracy-like values within [-1, 1]).
    record = make_result(
        kind="finetune",
        task="squad1",
        method="finetune",
        model={"name": "tiny"},
        metrics={"exact_match": 0.5, "f1": 0.9},
        details={"metric_scale": "percent"},
    )
    write_result(tmp_path / "pct.json", record)
    record = make_result(
        kind="finetune",
        task="squad1",
        method="finetune",
        model={"name": "tiny2"},
        metrics={"exact_match": 0.5, "f1": 0.9},
    )
    write_result(tmp_path / "frac.json", record)
    (tmp_path / "harness.json").write_text(
        json.dumps(
            {
                "results": {"hellaswag": {"acc,none": 0.3}, "piqa": {"acc,none": 0.6}},
                "config": {"model_args": "pretrained=gpt2"},
            }
        )
    )
    coll = collect_results([tmp_path])
    metrics = {r.model.name: dict(r.metrics) for r in coll.records}
    assert metrics == {"tiny": {"exact_match": 0.5, "f1": 0.9}, "tiny2": {"exact_match": 50.0, "f1": 90.0}}
    (skip,) = coll.skipped
    assert skip.path.name == "harness.json" and "tasks: hellaswag, piqa" in skip.reason
