"""lm-evaluation-harness result files as :class:`~mlm_eval.report.records.RunRecord` s.

``{"results": {"wikitext": {"word_perplexity,none": ...}}, "config": {"model_args": ...}}`` and
the older form without the ``,none`` filter suffix; tagged with source and method
``lm-eval-harness``. The harness writes fractions; ``config.limit`` marks a partial run and the
``dtype`` of ``model_args`` the weights' precision. Such records carry no weights fingerprint: a
harness row is keyed by its model name.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any

from mlm_eval.report.records import (
    DTYPE_NAMES,
    SOURCE_HARNESS,
    MalformedResult,
    ModelKey,
    RunRecord,
    is_int,
    is_number,
    to_percent,
)

# lm-evaluation-harness task -> (our task, {harness metric: our metric}).
HARNESS_TASKS: dict[str, tuple[str, dict[str, str]]] = {
    "wikitext": (
        "wikitext103",
        {
            "word_perplexity": "word_perplexity",
            "byte_perplexity": "byte_perplexity",
            "bits_per_byte": "bits_per_byte",
        },
    ),
    # Older harness versions call the LAMBADA perplexity "ppl".
    "lambada_openai": ("lambada", {"acc": "accuracy", "perplexity": "ppl", "ppl": "ppl"}),
    "lambada": ("lambada", {"acc": "accuracy", "perplexity": "ppl", "ppl": "ppl"}),
    "mnli": ("mnli", {"acc": "accuracy_m"}),
    "mnli_mismatch": ("mnli", {"acc": "accuracy_mm"}),
    "qqp": ("qqp", {"acc": "accuracy", "f1": "f1"}),
    "cola": ("cola", {"mcc": "mcc"}),
    "sst2": ("sst2", {"acc": "accuracy"}),
    "mrpc": ("mrpc", {"acc": "accuracy", "f1": "f1"}),
    "qnli": ("qnli", {"acc": "accuracy"}),
    "rte": ("rte", {"acc": "accuracy"}),
    "wnli": ("wnli", {"acc": "accuracy"}),
}


def parse_harness(path: Path, data: dict[str, Any]) -> list[RunRecord]:
    raw_config = data.get("config")
    config: dict[str, Any] = raw_config if isinstance(raw_config, dict) else {}
    name = _harness_model_name(data, config)
    model_args = _harness_args(config)
    dtype = model_args.get("dtype")
    limit = config.get("limit")
    params = config.get("model_num_parameters")
    created = _harness_time(path, data)
    seed = config.get("random_seed")
    records: list[RunRecord] = []
    unknown: list[str] = []
    for harness_task, values in sorted(data["results"].items()):
        if harness_task not in HARNESS_TASKS or not isinstance(values, dict):
            unknown.append(str(harness_task))
            continue
        task, names = HARNESS_TASKS[harness_task]
        metrics = _harness_metrics(values, names)
        if metrics:
            records.append(
                RunRecord(
                    path=path,
                    source=SOURCE_HARNESS,
                    kind="eval",
                    task=task,
                    method=SOURCE_HARNESS,
                    model=ModelKey(name=name, iteration=None, layout=None),
                    parameters=params if is_int(params) else None,
                    checkpoint=None,
                    metrics=to_percent(metrics, None, "fraction")[0],
                    seed=seed if is_int(seed) else None,
                    created=created,
                    dtype=DTYPE_NAMES.get(dtype, dtype)
                    if isinstance(dtype, str) and dtype != "auto"
                    else None,
                    limit=int(limit) if isinstance(limit, (int, float)) and is_number(limit) else None,
                    unit_rule="producer",
                )
            )
    if not records:
        found = ", ".join(unknown) or "none"
        raise MalformedResult(f"lm-evaluation-harness file without a leaderboard task (tasks: {found})")
    return records


def _harness_metrics(values: dict[str, Any], names: dict[str, str]) -> dict[str, float]:
    """Keep unfiltered (``,none``) or suffix-less metrics; stderr and aliases are dropped."""
    out: dict[str, float] = {}
    for key, value in values.items():
        metric, _, filt = str(key).partition(",")
        if filt not in ("", "none") or metric not in names:
            continue
        if not is_number(value):
            raise MalformedResult(f"results metric {key!r}: expected a finite number, got {value!r}")
        out[names[metric]] = float(value)
    return out


def _harness_model_name(data: dict[str, Any], config: dict[str, Any]) -> str:
    name = data.get("model_name")
    if not isinstance(name, str) or not name:
        name = _harness_args(config).get("pretrained")
    if not isinstance(name, str) or not name:
        name = config.get("model") if isinstance(config.get("model"), str) else None
    if not name:
        raise MalformedResult("lm-evaluation-harness file: no model name in config.model_args")
    # A local path names the model by its last component.
    return name.rstrip("/").rsplit("/", 1)[-1] if name.startswith(("/", ".")) else name


def _harness_args(config: dict[str, Any]) -> dict[str, Any]:
    args = config.get("model_args")
    if isinstance(args, str):
        args = dict(p.partition("=")[::2] for p in args.split(",") if p)
    return args if isinstance(args, dict) else {}


def _harness_time(path: Path, data: dict[str, Any]) -> _dt.datetime:
    stamp: Any = data.get("date")
    # Older harness files carry no date: fall back to the file's modification time.
    seconds = float(stamp) if is_number(stamp) else path.stat().st_mtime
    return _dt.datetime.fromtimestamp(seconds, tz=_dt.timezone.utc)
