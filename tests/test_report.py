"""``mlm-eval report``: collection, reduction, ranking, best marks, references and the outputs."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest

from mlm_eval.cli import main as eval_main
from mlm_eval.report.collect import collect_results
from mlm_eval.report.columns import format_value, lower_is_better
from mlm_eval.report.paper_reference import PAPER_ROWS
from mlm_eval.report.plots import plot_figures
from mlm_eval.report.records import is_percent_metric
from mlm_eval.report.table import (
    MISSING,
    Leaderboard,
    Row,
    SortKey,
    TableConfig,
    build_leaderboard,
    parse_sort_key,
)
from pretrain.utils.errors import UserError
from pretrain.utils.results import make_result, write_result
from tests import report_fixtures as rf

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
    details: dict[str, Any] | None = None,
) -> None:
    record = make_result(
        kind=kind,
        task=task,
        method=method,
        model={"name": name, "parameters": params, "iteration": iteration, "layout": layout},
        metrics=metrics,
        seed=seed,
        details=details,
    )
    record = rf.legacy(record)  # as older versions wrote it: no declared units
    record["created"] = created
    write_result(path, record)


def write_fixtures(root: Path) -> None:
    """Several models, duplicates over seeds and times, an lm-eval-harness file, and bad files."""
    ev, ft = root / "eval", root / "finetune" / "mnli"
    ev.mkdir(parents=True)
    ft.mkdir(parents=True)
    m125, m350 = 125_000_000, 350_000_000
    # gpt-a at iteration 1000 was evaluated twice: the latest (28.0) must win over the older 30.0;
    # mlm-eval writes LAMBADA accuracy as a fraction (shown as 40.00 percent). gpt-b has no LAMBADA
    # result: a missing cell. Columns: file, name, task, metrics, day, parameters, iteration.
    gpt_runs = [
        ("a1k_old", "gpt-a", "wikitext103", {"adjusted_ppl": 30.0}, 1, m125, 1000),
        ("a1k_new", "gpt-a", "wikitext103", {"adjusted_ppl": 28.0}, 2, m125, 1000),
        ("a1k_lambada", "gpt-a", "lambada", {"accuracy": 0.40, "count": 50, "correct": 20}, 2, m125, 1000),
        ("a2k", "gpt-a", "wikitext103", {"adjusted_ppl": 25.0}, 3, m125, 2000),
        ("a2k_lambada", "gpt-a", "lambada", {"accuracy": 0.455}, 3, m125, 2000),
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
        details={"metric_scale": "fraction"},
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
    coll = collect_results([root])
    return build_leaderboard(coll.records, TableConfig(**kw), coll.hygiene)


@pytest.fixture(scope="module")
def realistic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("realistic")
    rf.write_demo(root)
    rf.write_realistic(root)
    return root


def _row(board: Leaderboard, name: str, iteration: int | None = None) -> Row:
    (row,) = [r for r in board.rows if r.name == name and (iteration is None or r.iteration == iteration)]
    return row


def _value(row: Row, key: str) -> float | None:
    return row.cells[key].value if key in row.cells else None


def test_collect_reads_both_formats_hygiene_and_skips_bad_files_by_name(results_dir: Path) -> None:
    coll = collect_results([results_dir, results_dir / "eval"])  # overlapping dirs count once
    skipped = {s.path.name: s.reason for s in coll.skipped}
    assert set(skipped) == {"broken.json", "foreign.json", "bad_metric.json"}
    assert "not valid JSON" in skipped["broken.json"]
    assert "metrics.accuracy" in skipped["bad_metric.json"]
    (hygiene,) = coll.hygiene  # a data record, kept apart from model results
    assert (hygiene.name, hygiene.eval_task, hygiene.share) == ("owt", "lambada", pytest.approx(1.0))
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
    assert {r.dtype for r in harness if r.model.name == "gpt2"} == {"float32"}


def test_units_are_declared_or_the_producers_definition_never_guessed_from_values(tmp_path: Path) -> None:
    # A tiny model's SQuAD EM of 0.5 percent from an older mlm-finetune record (no unit) stays 0.5:
    # mlm-finetune writes percent. A record declaring fractions is scaled, per metric too.
    def write(name: str, kind: str, metrics: dict[str, float], **top: Any) -> None:
        record = make_result(kind=kind, task="squad1" if kind == "finetune" else "lambada",
                             method="finetune" if kind == "finetune" else "paper",
                             model={"name": name}, metrics=metrics)  # fmt: skip
        write_result(tmp_path / f"{name}.json", rf.legacy(record) | top)

    write("old-ft", "finetune", {"exact_match": 0.5, "f1": 0.9})
    write("declared", "finetune", {"exact_match": 0.5, "f1": 90.0}, units={"exact_match": "fraction"})
    write("old-eval", "eval", {"accuracy": 0.9, "ppl": 0.9})  # mlm-eval writes fractions
    write("eval-percent", "eval", {"accuracy": 45.0}, metric_unit="percent")
    write("bad-unit", "eval", {"accuracy": 45.0}, metric_unit="per mille")
    # The current schema (pretrain.utils.results): a per-metric units map, unnamed metrics are plain.
    write("new-eval", "eval", {"accuracy": 0.5, "ppl": 3.0}, units={"accuracy": "fraction"})
    write(
        "new-ft",
        "finetune",
        {"exact_match": 71.0, "f1": 0.8},
        units={"exact_match": "percent", "f1": "fraction"},
    )
    coll = collect_results([tmp_path])
    metrics = {r.model.name: dict(r.metrics) for r in coll.records}
    assert metrics == {
        "old-ft": {"exact_match": 0.5, "f1": 0.9},
        "declared": {"exact_match": 50.0, "f1": 90.0},
        "old-eval": pytest.approx({"accuracy": 90.0, "ppl": 0.9}),
        "eval-percent": {"accuracy": 45.0},
        "new-eval": {"accuracy": 50.0, "ppl": 3.0},
        "new-ft": pytest.approx({"exact_match": 71.0, "f1": 80.0}),
    }
    (bad,) = coll.skipped
    assert (
        bad.path.name == "bad-unit.json" and "'metric_unit': expected 'percent' or 'fraction'" in bad.reason
    )


def test_one_row_per_weights_with_layouts_and_formats_as_detail(realistic: Path) -> None:
    board = _board(realistic, with_paper=True)
    runs = [r for r in board.rows if not r.reference]
    assert len(runs) == 8  # 18 results: 7 fingerprints and one harness model
    demo = _row(board, "demo-gpt")  # tp2/pp2, its tp1 reshard and its HF export: one row
    assert demo.fingerprint == rf.DEMO_GPT and demo.formats == ("HF", "tp1-pp1-vp1", "tp2-pp2-vp1")
    assert demo.aliases == ("hf_gpt2",)
    assert _value(demo, WT) == 21712036.37  # the newest of the two layouts' runs
    bert = _row(board, "bert-336m")  # the most used name; the HF export's name is an alias
    assert bert.aliases == ("bert-336m-hf",) and bert.formats == ("HF", "tp1-pp1-vp1", "tp2-pp1-vp1")
    # Finetuning in percent (declared and older records) and in fractions: all on one scale.
    assert (_value(bert, MNLI_M), _value(bert, "qqp:f1"), _value(bert, "sst2:accuracy")) == (
        89.12,
        88.91,
        93.23,
    )
    assert _value(bert, "squad1:f1") == pytest.approx(93.81)
    # Two iterations of gpt-345m are different weights: two rows with the same name.
    assert [r.iteration for r in board.rows if r.name == "gpt-345m"] == [300_000, 100_000]
    # Only columns some run has: the paper's SQuAD 2.0 and RACE numbers bring no column.
    tasks = {c.task for c in board.columns}
    assert "squad2" not in tasks and "race" not in tasks and "squad1" in tasks
    families = list(dict.fromkeys(c.family for c in board.columns))
    assert families == ["Zero-shot LM", "GLUE", "SQuAD", "Data hygiene"]
    # The contamination record of gpt-345m's training data on LAMBADA: a Data hygiene column too.
    hygiene = board.columns[-1]
    assert (hygiene.key, hygiene.label) == (
        "contamination:lambada",
        "Train-data overlap LAMBADA % ↓",
    )
    g345 = _row(board, "gpt-345m", 300_000)
    assert _value(g345, hygiene.key) == pytest.approx(0.83) and not g345.cells[hygiene.key].best


def test_full_results_win_partial_and_bf16_runs_are_marked(realistic: Path) -> None:
    board = _board(realistic)
    g345 = _row(board, "gpt-345m", 300_000)
    # The newer --limit 50 run (60.00) never replaces the full result.
    assert _value(g345, LA) == pytest.approx(44.32) and not g345.cells[LA].partial
    # The bf16 run of the HF export is kept as a variant; the float32 value is shown.
    wt = g345.cells[WT]
    assert (wt.value, wt.dtype, wt.variants) == (19.84, "float32", (("bfloat16", 19.87),))
    g13 = _row(board, "gpt-1.3b")  # only a bf16 run: shown, marked
    assert g13.cells[WT].marks() == ["bf16"] and g13.rank == 1 and g13.cells[WT].best
    g760 = _row(board, "gpt-760m")  # only a partial run: shown, marked, unranked, never best
    assert g760.cells[LA].marks() == ["partial n=100"] and g760.rank is None and not g760.cells[LA].best
    demo = _row(board, "demo-gpt")
    assert demo.cells[WT].marks() == ["sample data"] and demo.rank is None
    assert _row(board, "ckpt_bert").cells["sst2:accuracy"].marks() == ["sample data"]
    # The contamination record names gpt-345m: beside its LAMBADA score (the task's first metric).
    assert (
        g345.cells[LA].marks() == ["contaminated 0.83%"] and g345.cells["lambada:ppl"].contamination is None
    )
    assert [r.name for r in board.rows if r.rank] == ["gpt-1.3b", "gpt-345m", "gpt-345m"]


def test_best_only_where_the_difference_reaches_the_printed_precision(tmp_path: Path) -> None:
    def run(name: str, task: str, metrics: dict[str, float]) -> None:
        rf.result(tmp_path / f"{name}-{task}.json", name=name, task=task, metrics=metrics,
                  created="2024-01-01T00:00:00Z", fingerprint="w1:" + name[-1] * 64)  # fmt: skip

    run("ma", "wikitext103", {"adjusted_ppl": 21712037.97, "token_ppl": 19.843})
    run("mb", "wikitext103", {"adjusted_ppl": 21712036.37, "token_ppl": 19.84})
    run("ma", "lambada", {"accuracy": 0.4433, "ppl": 10.0})
    run("mb", "lambada", {"accuracy": 0.4432, "ppl": 10.01})
    board = _board(tmp_path)
    best = {(r.name, k) for r in board.rows for k, c in r.cells.items() if c.best}
    # 1.6 in 2.2e7 and 0.003 in 19.84 are below the 4th significant figure: nobody is best.
    # 0.01 percentage points and 0.01 in 10.00 are exactly the printed precision: best.
    assert best == {("ma", LA), ("ma", "lambada:ppl")}
    assert [format_value(v, percent=False) for v in (21712037.97, 1509398406.4, 19.31, 1.6, 5211.2, 12345.6)] == [
        "2.171e7", "1.509e9", "19.31", "1.600", "5211", "1.235e4"
    ]  # fmt: skip
    assert format_value(45.178, percent=True) == "45.18" and format_value(None, percent=True) == MISSING


def test_plots_use_log_axes_legends_and_skip_single_points(realistic: Path, tmp_path: Path) -> None:
    board = _board(realistic, with_paper=True)
    (params_title, _, params_fig), (curve_title, _, curve_fig) = plot_figures(board)
    assert params_title == "Metric vs parameter count" and curve_title.startswith("Learning curves")
    titles = {ax.get_title(): ax for ax in params_fig.axes}
    wiki = titles["WikiText-103 adj. ppl ↓"]
    assert wiki.get_xscale() == "log" and wiki.get_yscale() == "log"
    assert (
        titles["LAMBADA acc % ↑"].get_yscale() == "linear" and titles["LAMBADA acc % ↑"].get_ylim()[1] <= 101
    )
    assert all(not ax.texts for ax in params_fig.axes)  # names only in the legend: nothing can overlap
    (legend,) = params_fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert "Megatron GPT-2 355M (paper Table 3)" in labels and "Megatron BERT 1.3B (paper Table 5)" in labels
    assert "gpt-345m (iter 300k)" in labels and "demo-gpt" not in labels  # sample data is not plotted
    # The token-ppl column has one comparable point: no panel.
    assert "WikiText-103 token ppl ↓" not in titles
    # Learning curves: only gpt-345m has results at two iterations.
    (curve_legend,) = curve_fig.legends
    assert [t.get_text() for t in curve_legend.get_texts()] == ["gpt-345m"]
    # One model, one iteration: nothing to plot.
    rf.result(tmp_path / "one.json", name="solo", task="lambada", metrics={"accuracy": 0.5}, params=10**8,
              iteration=5, created="2024-01-01T00:00:00Z")  # fmt: skip
    assert plot_figures(_board(tmp_path)) == []


def test_median_rule_is_over_seeds(results_dir: Path) -> None:
    board = _board(results_dir, reduce="median", sort_by=SortKey(task="mnli"))
    bert_x = _row(board, "bert-x")
    # Seeds 1 (latest run 80/79), 2 (84/83), 3 (81/80): medians 81 and 80, not over all 4 runs.
    assert (_value(bert_x, MNLI_M), _value(bert_x, MNLI_MM)) == (81.0, 80.0)
    assert bert_x.cells[MNLI_M].n_runs == 3 and set(bert_x.cells[MNLI_M].seeds) == {1, 2, 3}
    assert [r.name for r in board.rows if r.rank is not None] == ["bert-y", "bert-x"]
    assert "median over seeds" in board.rule


def test_latest_rule_ranking_and_missing_cells(results_dir: Path) -> None:
    board = _board(results_dir, reduce="latest")
    assert board.sort_column.key == WT  # default: first task column with a run
    ranked = [(r.name, r.iteration, r.rank) for r in board.rows if r.rank is not None]
    assert ranked == [("gpt-b", 2000, 1), ("gpt-a", 2000, 2), ("gpt-a", 1000, 3)]  # lower ppl first
    a1k = _row(board, "gpt-a", 1000)
    assert _value(a1k, WT) == 28.0 and a1k.cells[WT].n_runs == 2  # latest of 30.0 / 28.0
    assert _value(a1k, LA) == pytest.approx(40.0)  # fraction -> percent
    assert _value(_row(board, "gpt-b"), LA) is None  # missing
    labels = {c.key: c.label for c in board.columns}
    assert labels[WT] == "WikiText-103 adj. ppl ↓"
    assert labels["wikitext103:word_perplexity@lm-eval-harness"] == "WikiText-103 word ppl ↓ [harness]"
    assert all(c.lower_is_better == ("ppl" in c.metric or "per" in c.metric) for c in board.columns)


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


def test_reference_rows_are_marked_unranked_and_never_best(realistic: Path) -> None:
    board = _board(realistic, with_paper=True)
    refs = [r for r in board.rows if r.reference]
    assert len(refs) == len(PAPER_ROWS) == 8
    assert board.rows[-len(refs) :] == tuple(refs)  # after all runs
    assert all(r.rank is None and not any(c.best for c in r.cells.values()) for r in refs)
    gpt83 = _row(board, "Megatron GPT-2 8.3B")
    assert (_value(gpt83, WT), _value(gpt83, LA), gpt83.table) == (10.81, 66.51, "Table 3")
    assert refs[0] is gpt83  # references sorted by the sort column too (lowest ppl first)
    bert39 = _row(board, "Megatron BERT 3.9B")
    assert (_value(bert39, MNLI_M), _value(bert39, "squad1:f1"), bert39.table) == (91.4, 95.5, "Table 5")
    assert _value(_row(board, "Previous SOTA"), WT) == 15.79


def test_metric_direction_and_scale_rules() -> None:
    assert lower_is_better("wikitext103", "adjusted_ppl") and lower_is_better("wikitext103", "bits_per_byte")
    assert lower_is_better("lambada", "ppl") and not lower_is_better("lambada", "accuracy")
    assert lower_is_better("newtask", "byte_perplexity") and not lower_is_better("newtask", "score")
    assert is_percent_metric("accuracy_mm") and is_percent_metric("exact_match") and is_percent_metric("f1")
    assert not is_percent_metric("adjusted_ppl") and not is_percent_metric("bits_per_byte")


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
def test_md_csv_json_carry_the_same_rows_values_and_marks(
    realistic: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    assert eval_main(["report", "--results", str(realistic), "--out", str(out), "--with-paper"]) == 0
    printed = capsys.readouterr().out
    assert "partial" in printed and "2.171e7" in printed  # the terminal table too
    doc = json.loads((out / "leaderboard.json").read_text())
    md = (out / "leaderboard.md").read_text()
    rows = list(csv.DictReader(io.StringIO((out / "leaderboard.csv").read_text())))
    assert doc["schema"] == "mlm-toolkit/leaderboard/v1"
    assert [r["name"] for r in doc["rows"]] == [r["model"].split(" (paper")[0] for r in rows]
    assert {c["family"] for c in doc["columns"]} == {"Zero-shot LM", "GLUE", "SQuAD", "Data hygiene"}
    wt = next(c for c in doc["columns"] if c["key"] == WT)
    assert (wt["unit"], wt["lower_is_better"]) == ("ppl", True)
    by_name = {r["name"]: r for r in doc["rows"]}
    demo, g760 = by_name["demo-gpt"], by_name["gpt-760m"]
    assert demo["cells"][WT]["text"] == "2.171e7" and demo["cells"][WT]["marks"] == ["sample data"]
    assert g760["cells"][LA] | {"sources": None} == g760["cells"][LA] | {
        "text": "54.00", "partial": True, "limit": 100, "marks": ["partial n=100"], "best": False, "sources": None,
    }  # fmt: skip
    assert demo["formats"] == ["HF", "tp1-pp1-vp1", "tp2-pp2-vp1"] and demo["fingerprint"] == rf.DEMO_GPT
    # The same value, marks and best in Markdown and CSV.
    demo_md = next(line for line in md.splitlines() if line.startswith("| — | demo-gpt |"))
    assert "2.171e7 [sample data]" in demo_md and "HF, tp1-pp1-vp1, tp2-pp2-vp1" in demo_md
    assert "| 1 | gpt-1.3b | 1.32B |" in md and "**15.72 [bf16]**" in md
    csv_13 = next(r for r in rows if r["model"] == "gpt-1.3b")
    assert csv_13["WikiText-103 adj. ppl ↓"] == "15.72" and csv_13["marks"] == f"{WT}: bf16"
    assert csv_13["best"] == f"{WT}; {LA}; lambada:ppl" and csv_13["fingerprint"] == rf.GPT13B
    csv_345 = next(r for r in rows if r["model"] == "gpt-345m" and r["iteration"] == "300000")
    assert csv_345["marks"] == f"{LA}: contaminated 0.83%"
    for text in ("Mark 'partial'", "Mark 'sample data'", "One row per model", "references, not runs"):
        assert text in md and any(text in n for n in doc["notes"])


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
def test_cli_warns_per_bad_file_and_ignores_its_own_output(
    results_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    rc = eval_main(["report", "--results", str(results_dir), "--out", str(out), "--reduce", "median"])
    assert rc == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: skipped")]
    assert sorted(Path(w.split()[2].rstrip(":")).name for w in warnings) == [
        "bad_metric.json",
        "broken.json",
        "foreign.json",
    ]
    assert sorted(p.name for p in out.iterdir()) == [
        "leaderboard.csv",
        "leaderboard.html",
        "leaderboard.json",
        "leaderboard.md",
    ]
    doc = json.loads((out / "leaderboard.json").read_text())
    assert "median over seeds" in doc["reduce"]["description"]
    # The contamination record names no model of these results: said so in the notes.
    assert any("matches no model row" in n for n in doc["notes"])
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


def test_a_full_bf16_run_is_shown_before_a_partial_float32_one(tmp_path: Path) -> None:
    common: dict[str, Any] = dict(
        name="m", task="lambada", fingerprint=rf.GPT345, created="2024-01-01T00:00:00Z"
    )
    rf.result(
        tmp_path / "partial.json", metrics={"accuracy": 0.5}, top={"limit": 10, "dtype": "float32"}, **common
    )
    rf.result(tmp_path / "bf16.json", metrics={"accuracy": 0.4}, top={"dtype": "bfloat16"}, **common)
    (row,) = _board(tmp_path).rows
    cell = row.cells[LA]
    assert (cell.value, cell.marks(), cell.variants) == (40.0, ["bf16"], (("float32, partial", 50.0),))
