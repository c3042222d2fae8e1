"""The result record every evaluation and finetuning run writes (read by ``mlm-eval report``).

Schema ``mlm-toolkit/result/v1`` (one JSON object per file)::

    {
      "schema": "mlm-toolkit/result/v1",
      "kind": "eval" | "finetune",
      "task": "wikitext103" | "lambada" | "mnli" | "qqp" | "squad1" | "squad2" | "race" | "cola" | ...,
      "method": "paper" | "lm-eval" | "last-token" | ...,      # how the metric was computed
      "model": {"name": str, "parameters": int | null, "iteration": int | null,
                "layout": "tp2-pp1-vp1" | null, "checkpoint": str | null,
                "fingerprint": "w1:<64 hex>" | null},   # same weights, same string (any layout/format)
      "metrics": {str: float | int},    # task-specific, see TASK_METRICS
      "seed": int | null,
      "created": ISO-8601 UTC time,
      "details": {...}                  # optional, free-form
    }
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path
from typing import Any

from pretrain.utils.atomic import atomic_open

RESULT_SCHEMA = "mlm-toolkit/result/v1"

# The headline metric of each task and whether lower is better.
TASK_METRICS: dict[str, dict[str, bool]] = {
    "wikitext103": {"adjusted_ppl": True, "token_ppl": True, "word_perplexity": True},
    "lambada": {"accuracy": False, "ppl": True},
    "mnli": {"accuracy_m": False, "accuracy_mm": False},
    "qqp": {"accuracy": False, "f1": False},
    "squad1": {"exact_match": False, "f1": False},
    "squad2": {"exact_match": False, "f1": False},
    "race": {"accuracy_middle": False, "accuracy_high": False, "accuracy": False},
    "cola": {"mcc": False},
    "sst2": {"accuracy": False},
    "mrpc": {"accuracy": False, "f1": False},
    "stsb": {"pearson": False, "spearman": False},
    "qnli": {"accuracy": False},
    "rte": {"accuracy": False},
    "wnli": {"accuracy": False},
    "contamination": {"share": True, "unique_share": True},
}


def make_result(
    *,
    kind: str,
    task: str,
    method: str,
    model: dict[str, Any],
    metrics: dict[str, float | int],
    seed: int | None = None,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build a result record in the v1 schema."""
    return {
        "schema": RESULT_SCHEMA,
        "kind": kind,
        "task": task,
        "method": method,
        "model": {
            "name": model.get("name"),
            "parameters": model.get("parameters"),
            "iteration": model.get("iteration"),
            "layout": model.get("layout"),
            "checkpoint": model.get("checkpoint"),
            "fingerprint": model.get("fingerprint"),  # pretrain.checkpoint.fingerprint of the weights
            # where the tokenizer came from; "forced" lists what --force-tokenizer overrode
            **({"tokenizer": model["tokenizer"]} if model.get("tokenizer") else {}),
        },
        "metrics": metrics,
        "seed": seed,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "details": details or {},
    }


def write_result(path: str | os.PathLike[str], record: dict[str, Any]) -> Path:
    """Write one result record atomically as indented JSON; returns the path."""
    path = Path(path)
    with atomic_open(path, "w", encoding="utf-8") as fh:
        json.dump(record, fh, indent=2, sort_keys=False)
        fh.write("\n")
    return path
