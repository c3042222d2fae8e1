"""``mlm-eval wikitext103``: WikiText-103 perplexity, the paper's method or lm-eval's.

Example::

    mlm-eval wikitext103 --hf-model ./gpt2-small --data wiki.test.tokens --seq-length 1024 --overlap 32
    mlm-eval wikitext103 --hf-model ./gpt2-small --data builtin:wikitext_sample.tokens --method lm-eval
    mlm-eval wikitext103 --ckpt ./ckpt --dataset wikitext --dataset-config wikitext-103-raw-v1 --limit 10
    torchrun --standalone --nproc-per-node 4 -m mlm_eval.cli wikitext103 --ckpt ./ckpt --data wiki.test.tokens \
        --tensor-model-parallel-size 2 --dtype bf16    # TP=2 x DP=2
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from mlm_eval.scoring.model_loading import LoadedModel
from mlm_eval.tasks.data_sources import add_data_arguments, load_wikitext_data
from mlm_eval.tasks.runner import Metrics, add_common_arguments, positive, run_task
from mlm_eval.tasks.wikitext import evaluate_wikitext_lm_eval, evaluate_wikitext_paper


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


def run(args: argparse.Namespace) -> int:
    """Evaluate, print the table, write the result (rank 0 under torchrun)."""
    task = WikitextArgs(
        seq_length=positive(args.seq_length, "--seq-length"),
        overlap=positive(args.overlap, "--overlap"),
        method=args.method,
        batch_size=positive(args.batch_size, "--batch-size"),
        limit=None if args.limit is None else positive(args.limit, "--limit"),
    )

    def evaluate(loaded: LoadedModel, raw_text: str | list[str]) -> Metrics:
        progress = not args.no_progress
        if task.method == "paper":
            stream = raw_text if isinstance(raw_text, str) else "\n".join(raw_text)  # pages -> the file
            return evaluate_wikitext_paper(
                loaded.scorer, loaded.tokenizer, stream, seq_length=task.seq_length, overlap=task.overlap,
                batch_size=task.batch_size, progress=progress, limit=task.limit,
            )  # fmt: skip
        return evaluate_wikitext_lm_eval(
            loaded.scorer, loaded.tokenizer, raw_text, seq_length=task.seq_length,
            batch_size=task.batch_size, progress=progress, limit=task.limit,
        )  # fmt: skip

    return run_task(
        args, task="wikitext103", method=task.method, load_data=load_wikitext_data, evaluate=evaluate
    )
