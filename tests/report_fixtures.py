"""Result files for the ``mlm-eval report`` tests: a dozen realistic results and the demo's.

Fingerprints are written as :mod:`pretrain.checkpoint.fingerprint` writes them (``w1:`` + 64 hex);
what matters here is which records share one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pretrain.utils.results import make_result, write_result

M345, B13, M760, B336 = 354_871_296, 1_315_575_808, 760_000_000, 336_226_108
DEMO_GPT = "w1:" + "a1" * 32
GPT345 = "w1:" + "b2" * 32
GPT345_EARLY = "w1:" + "c3" * 32
GPT13B = "w1:" + "d4" * 32
GPT760 = "w1:" + "e5" * 32
BERT336 = "w1:" + "f6" * 32
DEMO_BERT = "w1:" + "07" * 32
WIKI = "/data/wikitext-103/wiki.test.tokens"
LAMBADA = "/data/lambada/lambada_test.jsonl"
BUILTIN_WIKI = "/work/main/mlm_eval/builtin/wikitext_sample.tokens"


NEW_FIELDS = ("units", "partial", "limit", "dtype", "sample_data")


def legacy(record: dict[str, Any], *, keep: bool = False) -> dict[str, Any]:
    """``record`` as written before the unit/partial/dtype/sample fields existed (``keep``: as is)."""
    return dict(record) if keep else {k: v for k, v in record.items() if k not in NEW_FIELDS}


def result(
    path: Path,
    *,
    name: str,
    task: str,
    metrics: dict[str, float],
    created: str,
    kind: str = "eval",
    method: str = "paper",
    fingerprint: str | None = None,
    params: int | None = None,
    iteration: int | None = None,
    layout: str | None = None,
    seed: int | None = None,
    details: dict[str, Any] | None = None,
    top: dict[str, Any] | None = None,
) -> Path:
    """Write one result record as older versions did; ``top``: top-level fields newer records carry."""
    record = legacy(
        make_result(
            kind=kind,
            task=task,
            method=method,
            model={
                "name": name,
                "parameters": params,
                "iteration": iteration,
                "layout": layout,
                "fingerprint": fingerprint,
            },  # fmt: skip
            metrics=metrics,
            seed=seed,
            details=details,
        )
    )
    record["created"] = created
    record.update(legacy(top or {}, keep=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_result(path, record)


def _day(d: int) -> str:
    return f"2024-03-{d:02d}T12:00:00+00:00"


def write_demo(root: Path) -> None:
    """What ``mlm-demo`` leaves: a tp2/pp2 GPT evaluated on the built-in samples in three layouts/formats
    (tp2/pp2, its tp1 reshard, its HF export) and a tiny BERT finetuned on the built-in SST-2 task."""
    gpt: dict[str, Any] = {"name": "demo-gpt", "fingerprint": DEMO_GPT, "params": 3_449_216, "iteration": 200}
    sample: dict[str, Any] = {"data": "builtin:wikitext_sample.tokens", "dtype": "float32"}
    result(root / "demo/wikitext103-tp2.json", task="wikitext103", metrics={"adjusted_ppl": 21712037.97,
           "token_ppl": 5211.2}, created=_day(1), layout="tp2-pp2-vp1", details=sample, **gpt)  # fmt: skip
    result(root / "demo/wikitext103-tp1.json", task="wikitext103", metrics={"adjusted_ppl": 21712036.37,
           "token_ppl": 5211.1}, created=_day(2), layout="tp1-pp1-vp1", details=sample, **gpt)  # fmt: skip
    lam: dict[str, Any] = {"data": "builtin:lambada_sample.jsonl", "dtype": "float32"}
    result(root / "demo/lambada-hf.json", task="lambada", metrics={"accuracy": 0.02, "ppl": 1509398406.4},
           created=_day(2), details=lam, **{**gpt, "name": "hf_gpt2"})  # fmt: skip
    result(root / "demo/finetune_sst2/results.json", kind="finetune", method="single", task="sst2",
           metrics={"accuracy": 98.0}, created=_day(3), name="ckpt_bert", fingerprint=DEMO_BERT,
           iteration=100, layout="tp1-pp1-vp1", seed=1234, top={"metric_unit": "percent", "sample_data": True})  # fmt: skip


def write_realistic(root: Path) -> None:
    """A dozen results: several GPT sizes and iterations, layouts, an HF export, a --limit run, a
    bf16 run, a harness file, BERT finetuning in percent and in fraction from older records, and a
    contamination record."""
    ev, ft = root / "eval", root / "finetune"
    g345: dict[str, Any] = {"name": "gpt-345m", "fingerprint": GPT345, "params": M345, "iteration": 300_000}
    full: dict[str, Any] = {"data": WIKI, "dtype": "float32"}
    result(ev / "345m-wiki-tp2pp2.json", task="wikitext103", metrics={"adjusted_ppl": 19.84, "token_ppl": 25.31},
           created=_day(5), layout="tp2-pp2-vp1", details=full, **g345)  # fmt: skip
    # Its HF export in bf16: same weights, a reduced-precision variant of the same cell.
    result(ev / "345m-wiki-hf-bf16.json", task="wikitext103", metrics={"adjusted_ppl": 19.87, "token_ppl": 25.35},
           created=_day(6), details={"data": WIKI, "dtype": "bfloat16"}, **{**g345, "name": "gpt-345m-hf"})  # fmt: skip
    # An old record without a unit: mlm-eval's LAMBADA accuracy is a fraction by definition.
    result(ev / "345m-lambada.json", task="lambada", metrics={"accuracy": 0.4432, "ppl": 9.87},
           created=_day(5), layout="tp2-pp2-vp1", details={"data": LAMBADA}, **g345)  # fmt: skip
    # A later quick --limit run of the tp1 reshard never replaces the full result.
    result(ev / "345m-lambada-limit.json", task="lambada", metrics={"accuracy": 0.6, "ppl": 7.1}, created=_day(9),
           layout="tp1-pp1-vp1", details={"data": LAMBADA, "limit": 50}, top={"partial": True, "limit": 50},
           **g345)  # fmt: skip
    early: dict[str, Any] = {**g345, "fingerprint": GPT345_EARLY, "iteration": 100_000}
    result(ev / "345m-100k-wiki.json", task="wikitext103", metrics={"adjusted_ppl": 24.61}, created=_day(3),
           layout="tp2-pp2-vp1", details=full, **early)  # fmt: skip
    result(ev / "345m-100k-lambada.json", task="lambada", metrics={"accuracy": 0.3901, "ppl": 14.2},
           created=_day(3), layout="tp2-pp2-vp1", details={"data": LAMBADA}, **early)  # fmt: skip
    g13: dict[str, Any] = {
        "name": "gpt-1.3b",
        "fingerprint": GPT13B,
        "params": B13,
        "iteration": 300_000,
        "layout": "tp4-pp2-vp1",
    }
    result(ev / "1.3b-wiki-bf16.json", task="wikitext103", metrics={"adjusted_ppl": 15.72}, created=_day(7),
           details={"data": WIKI, "dtype": "bfloat16"}, **g13)  # fmt: skip
    result(ev / "1.3b-lambada.json", task="lambada", metrics={"accuracy": 0.5812, "ppl": 6.02}, created=_day(7),
           top={"units": {"accuracy": "fraction"}, "dtype": "float32", "partial": False, "limit": None}, **g13)  # fmt: skip
    g760: dict[str, Any] = {"name": "gpt-760m", "fingerprint": GPT760, "params": M760, "iteration": 200_000}
    result(ev / "760m-lambada-limit.json", task="lambada", metrics={"accuracy": 0.54, "ppl": 8.1},
           created=_day(8), layout="tp1-pp1-vp1", details={"data": LAMBADA, "limit": 100}, **g760)  # fmt: skip
    harness: dict[str, Any] = {
        "results": {"wikitext": {"word_perplexity,none": 37.37, "byte_perplexity,none": 1.6,
                                 "bits_per_byte,none": 0.678}},
        "config": {"model": "hf", "model_args": "pretrained=gpt2,dtype=float32", "model_num_parameters": 124439808},
        "date": 1709900000.0,
    }  # fmt: skip
    (root / "lm_eval_gpt2.json").write_text(json.dumps(harness))
    b336: dict[str, Any] = {
        "name": "bert-336m",
        "fingerprint": BERT336,
        "params": B336,
        "iteration": 2_000_000,
    }
    result(ft / "mnli.json", kind="finetune", method="median", task="mnli", metrics={"accuracy_m": 89.12,
           "accuracy_mm": 89.41}, created=_day(10), layout="tp1-pp1-vp1", top={"metric_unit": "percent"},
           **b336)  # fmt: skip
    # Older finetune records: no unit (mlm-finetune writes percent), and one declaring fractions.
    result(ft / "qqp.json", kind="finetune", method="median", task="qqp", metrics={"accuracy": 91.93, "f1": 88.91},
           created=_day(10), layout="tp2-pp1-vp1", **b336)  # fmt: skip
    result(ft / "sst2.json", kind="finetune", method="median", task="sst2", metrics={"accuracy": 0.9323},
           created=_day(11), details={"metric_scale": "fraction"}, **{**b336, "name": "bert-336m-hf"})  # fmt: skip
    result(ft / "squad1.json", kind="finetune", method="median", task="squad1",
           metrics={"exact_match": 0.8712, "f1": 0.9381}, created=_day(11), layout="tp1-pp1-vp1",
           top={"units": {"exact_match": "fraction", "f1": "fraction"}}, **b336)  # fmt: skip
    contamination = legacy(make_result(kind="eval", task="contamination", method="lambada-13gram",
                                model={"name": "gpt-345m"}, metrics={"share": 0.0083, "unique_share": 0.0101},
                                details={"eval_task": "lambada", "n": 13}))  # fmt: skip
    write_result(root / "hygiene" / "lambada-13gram.json", contamination)
