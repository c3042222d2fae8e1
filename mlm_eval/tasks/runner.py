"""The skeleton every ``mlm-eval`` task subcommand runs, and the flags they all take.

:func:`run_task`: check the result output, load the data, load the scorer, evaluate (timed), emit
the result (:mod:`mlm_eval.tasks.results`), and release the scorer even when evaluating fails. The
order is the contract: bad output paths and bad data fail in one line before a model is loaded.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TypeVar

from mlm_eval.scoring.model_loading import LoadedModel, add_model_arguments, load_scorer
from mlm_eval.tasks.data_sources import DataSource
from mlm_eval.tasks.results import check_result_output, emit_result
from pretrain.utils.errors import UserError

Data = TypeVar("Data")
Metrics = dict[str, float | int]


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


def positive(value: int, flag: str) -> int:
    """Reject a non-positive integer flag with a one-line error."""
    if value < 1:
        raise UserError(f"{flag} must be >= 1, got {value}")
    return value


def run_task(
    args: argparse.Namespace,
    *,
    task: str,
    method: str,
    load_data: Callable[[argparse.Namespace], tuple[Data, DataSource]],
    evaluate: Callable[[LoadedModel, Data], Metrics],
) -> int:
    """Run one evaluation: print the table and write the result (on rank 0 under torchrun)."""
    check_result_output(args)
    data, source = load_data(args)
    loaded = load_scorer(args)
    try:
        started = time.perf_counter()
        metrics = evaluate(loaded, data)
        emit_result(args, loaded, task=task, method=method, metrics=metrics, data=source, started=started)
    finally:
        loaded.close()
    return 0
