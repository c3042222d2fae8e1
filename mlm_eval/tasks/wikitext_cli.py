"""``mlm-eval wikitext103``: WikiText-103 perplexity, the paper's method or lm-eval's.

Example::

    mlm-eval wikitext103 --hf-model ./gpt2-small --data wiki.test.tokens --seq-length 1024 --overlap 32
    mlm-eval wikitext103 --hf-model ./gpt2-small --data builtin:wikitext_sample.tokens --method lm-eval
    mlm-eval wikitext103 --ckpt ./ckpt --dataset wikitext --dataset-config wikitext-103-raw-v1 --limit 10
    torchrun --standalone --nproc-per-node 4 -m mlm_eval.cli wikitext103 --ckpt ./ckpt --data wiki.test.tokens \
        --tensor-model-parallel-size 2 --dtype bf16    # TP=2 x DP=2

Also holds the output plumbing shared with ``mlm-eval lambada`` (table, result JSON).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlm_eval.scoring.model_loading import LoadedModel, add_model_arguments, load_scorer
from mlm_eval.scoring.scorer import as_text_encoder, document_prefix
from mlm_eval.tasks.data_sources import DataSource, add_data_arguments, load_wikitext_data
from mlm_eval.tasks.wikitext import evaluate_wikitext_lm_eval, evaluate_wikitext_paper
from pretrain.utils.errors import UserError
from pretrain.utils.outputs import check_writable_output
from pretrain.utils.results import make_result, normalized, write_result


@dataclass(frozen=True, kw_only=True)
class WikitextArgs:
    """The task flags of ``mlm-eval wikitext103``."""

    seq_length: int
    overlap: int
    method: str
    batch_size: int
    limit: int | None  # first N windows (paper) or documents (lm-eval)


def register(subparsers: Any) -> None:
    """Add the ``wikitext103`` subcommand."""
    parser = subparsers.add_parser("wikitext103", help="WikiText-103 perplexity (paper or lm-eval method)")
    add_data_arguments(
        parser,
        data_help="raw wiki.test.tokens (or builtin:wikitext_sample.tokens), a save_to_disk directory, "
        "or a parquet/JSON file of lines",
    )
    parser.add_argument("--seq-length", type=int, default=1024, help="window length in tokens (default 1024)")
    parser.add_argument(
        "--overlap", type=int, default=32, help="stride between windows, paper method (default 32)"
    )
    parser.add_argument("--method", choices=("paper", "lm-eval"), default="paper")
    add_common_arguments(parser)
    parser.set_defaults(func=run)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Batch size, output and model flags shared by the evaluation subcommands."""
    parser.add_argument("--batch-size", type=int, default=8, help="rows per forward pass (default 8)")
    parser.add_argument(
        "--limit", type=int, metavar="N", help="evaluate only the first N windows/documents/examples"
    )
    parser.add_argument(
        "--out", metavar="PATH", help="result JSON path (default: RESULTS_DIR/TASK-METHOD-MODEL.json)"
    )
    parser.add_argument(
        "--results-dir", default="results", help="where results go without --out (default results/)"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_model_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Evaluate, print the table, write the result (rank 0 under torchrun)."""
    task = WikitextArgs(
        seq_length=positive(args.seq_length, "--seq-length"),
        overlap=positive(args.overlap, "--overlap"),
        method=args.method,
        batch_size=positive(args.batch_size, "--batch-size"),
        limit=None if args.limit is None else positive(args.limit, "--limit"),
    )
    check_result_output(args)
    raw_text, source = load_wikitext_data(args)
    loaded = load_scorer(args)
    try:
        started = time.perf_counter()
        progress = not args.no_progress
        if task.method == "paper":
            stream = raw_text if isinstance(raw_text, str) else "\n".join(raw_text)  # pages -> the file
            metrics = evaluate_wikitext_paper(
                loaded.scorer, loaded.tokenizer, stream, seq_length=task.seq_length, overlap=task.overlap,
                batch_size=task.batch_size, progress=progress, limit=task.limit,
            )  # fmt: skip
        else:
            metrics = evaluate_wikitext_lm_eval(
                loaded.scorer, loaded.tokenizer, raw_text, seq_length=task.seq_length,
                batch_size=task.batch_size, progress=progress, limit=task.limit,
            )  # fmt: skip
        emit_result(args, loaded, task="wikitext103", method=task.method, metrics=metrics, data=source,
                    started=started)  # fmt: skip
    finally:
        loaded.close()
    return 0


def positive(value: int, flag: str) -> int:
    """Reject a non-positive integer flag with a one-line error."""
    if value < 1:
        raise UserError(f"{flag} must be >= 1, got {value}")
    return value


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
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        table.add_row(key, f"{value:.6g}" if isinstance(value, float) else str(value))
    Console().print(table)
