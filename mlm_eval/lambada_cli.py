"""``mlm-eval lambada``: LAMBADA cloze accuracy, strict (the paper's) or ``--last-token``.

Example::

    mlm-eval lambada --hf-model ./gpt2-small --data lambada_test.jsonl
    mlm-eval lambada --hf-model ./gpt2-small --data builtin:lambada_sample.jsonl --last-token
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlm_eval.builtin import resolve_data_path
from mlm_eval.lambada import evaluate_lambada, read_lambada_jsonl
from mlm_eval.model_loading import load_scorer
from mlm_eval.wikitext_cli import add_common_arguments, emit_result, positive


@dataclass(frozen=True, kw_only=True)
class LambadaArgs:
    """The task flags of ``mlm-eval lambada``."""

    data: Path
    last_token: bool
    batch_size: int


def register(subparsers: Any) -> None:
    """Add the ``lambada`` subcommand."""
    parser = subparsers.add_parser("lambada", help="LAMBADA cloze accuracy (strict, or --last-token)")
    parser.add_argument(
        "--data", required=True, help='jsonl of {"text": ...} (or builtin:lambada_sample.jsonl)'
    )
    parser.add_argument(
        "--last-token",
        action="store_true",
        help="score only the last subword token (upstream default) instead of the whole last word",
    )
    add_common_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Evaluate, print the table, write the result."""
    task = LambadaArgs(
        data=resolve_data_path(args.data),
        last_token=args.last_token,
        batch_size=positive(args.batch_size, "--batch-size"),
    )
    examples = read_lambada_jsonl(task.data)
    loaded = load_scorer(args)
    started = time.perf_counter()
    metrics = evaluate_lambada(
        loaded.scorer,
        loaded.tokenizer,
        examples,
        strict=not task.last_token,
        batch_size=task.batch_size,
        progress=not args.no_progress,
    )
    method = "last-token" if task.last_token else "paper"
    emit_result(args, loaded, task="lambada", method=method, metrics=metrics, data=task.data, started=started)
    return 0
