"""What an ``mlm-eval`` task run leaves behind: the result record, its path, and the table.

:func:`check_result_output` runs before any work (a bad ``--out``/``--results-dir`` or a
``--limit`` run over a full result fails in one line); :func:`emit_result` prints the metrics and
writes the ``mlm-toolkit/result/v1`` record (:mod:`pretrain.utils.results`) on the main rank,
saying when the number is not comparable with a full fp32 test-set run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from mlm_eval.scoring.model_loading import LoadedModel
from mlm_eval.scoring.scorer import as_text_encoder, document_prefix
from mlm_eval.tasks.data_sources import DataSource
from pretrain.utils.errors import UserError
from pretrain.utils.outputs import check_writable_output
from pretrain.utils.results import make_result, normalized, write_result


def emit_result(
    args: argparse.Namespace,
    loaded: LoadedModel,
    *,
    task: str,
    method: str,
    metrics: dict[str, float | int],
    data: DataSource,
    started: float,
) -> Path | None:
    """On the main rank: print the metrics as a table and write the result record (its path)."""
    if not loaded.is_main:
        return None
    details = {
        "data": data.label,
        "data_sha256": data.sha256,
        "elapsed_s": round(time.perf_counter() - started, 3),
        "vocab_size": loaded.scorer.vocab_size,
        "batch_size": args.batch_size,
        "limit": args.limit,
        "dtype": loaded.dtype,
        "layout": loaded.layout,
        "toolkit_version": toolkit_version(),
        "bos": bos_record(loaded.tokenizer),
    }
    units = {k: "fraction" for k in metrics if k in ACCURACY_LIKE}
    record = make_result(
        kind="eval", task=task, method=method, model=loaded.info, metrics=metrics, details=details,
        units=units, limit=args.limit, dtype=loaded.dtype, sample_data=data.sample_data,
    )  # fmt: skip
    path = result_path(args, task=task, method=method, name=str(loaded.info.get("name") or "model"))
    write_result(path, record)
    print_table(f"{task} ({method}) - {loaded.info.get('name')}", metrics)
    note = marks(args.limit, loaded.dtype, data)
    if note:  # a plain line: a partial, reduced-precision or sample-data number must not pass unmarked
        print(f"NOT COMPARABLE with full fp32 test-set results: {note}")
    print(f"wrote {path}")
    return path


ACCURACY_LIKE = ("accuracy",)  # stored as fractions (the record's "units" says so)


def marks(limit: int | None, dtype: str | None, data: DataSource) -> str:
    """What makes a number not comparable with a full fp32 test-set run, for the table title."""
    out = []
    if limit is not None:
        out.append(f"PARTIAL: first {limit} only")
    if dtype in ("bfloat16", "float16", "bf16", "fp16"):
        out.append(f"{dtype} weights")
    if data.sample_data:
        out.append("built-in SAMPLE data, not the test set")
    return "; ".join(out)


def result_path(args: argparse.Namespace, *, task: str, method: str, name: str) -> Path:
    """``--out``, else RESULTS_DIR/TASK-METHOD-MODEL.json (``...-limitN.json`` for ``--limit N``)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name)
    suffix = f"-limit{args.limit}" if args.limit is not None else ""
    return Path(args.out) if args.out else Path(args.results_dir) / f"{task}-{method}-{safe}{suffix}.json"


def check_result_output(args: argparse.Namespace) -> None:
    """Before any work: --out is a writable file name (or --results-dir a writable folder), and a
    --limit run never replaces a full result."""
    if args.out is None:
        check_writable_output(args.results_dir, kind="dir", flag="--results-dir", shared=True)
        return
    out = check_writable_output(args.out, kind="file", flag="--out")
    if args.limit is not None and out.is_file():
        try:
            previous = json.loads(out.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            return
        if isinstance(previous, dict) and previous.get("schema") and not normalized(previous)["partial"]:
            raise UserError(
                f"--out {out}: holds a full (not --limit) result; a --limit run must not replace it "
                "(drop --out to get a -limitN file name)"
            )


def bos_record(tokenizer: Any) -> dict[str, Any]:
    """How the documents began: ``prepended`` is True when the tokenizer's convention puts BOS
    before a document (Llama; WikiText paper method and LAMBADA then score after it), and
    ``prefix_token_id`` is the token lm-eval-style rolling windows start from (BOS, else EOS)."""
    encoder = as_text_encoder(tokenizer)
    return {"prepended": bool(document_prefix(encoder)), "prefix_token_id": encoder.prefix_token_id}


def toolkit_version() -> str | None:
    """The installed ``mlm-toolkit`` distribution's version (None when not installed)."""
    try:
        return importlib.metadata.version("mlm-toolkit")
    except importlib.metadata.PackageNotFoundError:
        return None


def print_table(title: str, metrics: dict[str, float | int]) -> None:
    """A two-column rich table of the metrics."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        table.add_row(key, f"{value:.6g}" if isinstance(value, float) else str(value))
    Console().print(table)
