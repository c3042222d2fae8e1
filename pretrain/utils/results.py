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
      "units": {str: "fraction" | "percent"},  # every accuracy-like metric's scale (see below)
      "partial": bool, "limit": int | null,    # --limit N: only the first N windows/examples
      "dtype": "float32" | "bfloat16" | "float16" | null,  # the weights' dtype while scoring
      "sample_data": bool,              # the built-in sample data, not the real test set
      "seed": int | null,
      "created": ISO-8601 UTC time,
      "details": {...}                  # optional, free-form
    }

The unit rule: a metric named in ``units`` is accuracy-like (accuracy, F1, exact match, MCC,
correlations, shares) and is stored on the scale given there, ``"fraction"`` (0..1) or
``"percent"`` (0..100); a metric not named is a plain value (perplexities, counts). Readers
never infer a scale from the numbers. Records written before these fields existed lack them;
:func:`normalized` gives such a record the defaults (``partial`` from ``details.limit``,
``dtype`` from ``details.dtype``, ``sample_data`` from a ``builtin:`` data label, ``units``
unknown: ``None``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path
from typing import Any

from pretrain.utils.atomic import atomic_open

RESULT_SCHEMA = "mlm-toolkit/result/v1"
UNITS = ("fraction", "percent")

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
    "sft": {"valid_loss": True},  # mlm-finetune sft: token-weighted mean NLL of the validation file
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
    units: dict[str, str] | None = None,
    limit: int | None = None,
    dtype: str | None = None,
    sample_data: bool = False,
) -> dict[str, Any]:
    """Build a result record in the v1 schema (``units``: see the module's unit rule)."""
    for name, unit in (units or {}).items():
        if unit not in UNITS:
            raise ValueError(f"units[{name!r}] must be one of {UNITS}, got {unit!r}")
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
        "units": dict(units or {}),
        "partial": limit is not None,
        "limit": limit,
        "dtype": dtype,
        "sample_data": sample_data,
        "seed": seed,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "details": details or {},
    }


def normalized(record: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``record`` with every field of the current schema (defaults for older records)."""
    out = dict(record)
    details = out.get("details") or {}
    out.setdefault("limit", details.get("limit"))
    out.setdefault("partial", out["limit"] is not None)
    out.setdefault("dtype", details.get("dtype"))
    label = details.get("data")
    out.setdefault("sample_data", isinstance(label, str) and label.startswith("builtin:"))
    out.setdefault("units", None)
    return out


def write_result(path: str | os.PathLike[str], record: dict[str, Any]) -> Path:
    """Write one result record atomically as indented JSON; returns the path."""
    path = Path(path)
    with atomic_open(path, "w", encoding="utf-8") as fh:
        json.dump(record, fh, indent=2, sort_keys=False)
        fh.write("\n")
    return path
