"""``mlm-eval lambada``: LAMBADA cloze accuracy, strict (the paper's) or ``--last-token``.

Example::

    mlm-eval lambada --hf-model ./gpt2-small --data lambada_test.jsonl
    mlm-eval lambada --hf-model ./gpt2-small --data builtin:lambada_sample.jsonl --last-token
    mlm-eval lambada --ckpt ./ckpt --dataset EleutherAI/lambada_openai --dataset-config default --limit 100
    torchrun --standalone --nproc-per-node 2 -m mlm_eval.cli lambada --ckpt ./ckpt --data lambada_test.jsonl \
        --pipeline-model-parallel-size 2
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from mlm_eval.scoring.model_loading import LoadedModel
from mlm_eval.tasks.data_sources import add_data_arguments, load_lambada_data
from mlm_eval.tasks.lambada import evaluate_lambada
from mlm_eval.tasks.runner import Metrics, add_common_arguments, positive, run_task


@dataclass(frozen=True, kw_only=True)
class LambadaArgs:
    """The task flags of ``mlm-eval lambada``."""

    last_token: bool
    batch_size: int
    limit: int | None  # first N examples


def register(subparsers: Any) -> None:
    """Add the ``lambada`` subcommand."""
    parser = subparsers.add_parser("lambada", help="LAMBADA cloze accuracy (strict, or --last-token)")
    add_data_arguments(
        parser,
        data_help='jsonl of {"text": ...} (or builtin:lambada_sample.jsonl), a save_to_disk directory, '
        "or a parquet/JSON file",
    )
    parser.add_argument(
        "--last-token",
        action="store_true",
        help="score only the last subword token (upstream default) instead of the whole last word",
    )
    add_common_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Evaluate, print the table, write the result (rank 0 under torchrun)."""
    task = LambadaArgs(
        last_token=args.last_token,
        batch_size=positive(args.batch_size, "--batch-size"),
        limit=None if args.limit is None else positive(args.limit, "--limit"),
    )

    def evaluate(loaded: LoadedModel, examples: list[str]) -> Metrics:
        return evaluate_lambada(
            loaded.scorer,
            loaded.tokenizer,
            examples[: task.limit],
            strict=not task.last_token,
            batch_size=task.batch_size,
            progress=not args.no_progress,
        )

    method = "last-token" if task.last_token else "paper"
    return run_task(args, task="lambada", method=method, load_data=load_lambada_data, evaluate=evaluate)
