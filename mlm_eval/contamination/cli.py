"""``mlm-eval contamination``: the share of an eval set's word n-grams found in training corpora.

Paper sec. 5.2 (following Radford et al., 2019) reports the percentage of test-set 8-grams that
also appear in the training set: at most 10.8% for the WikiText-103 test set (which already has
9.09% overlap with the WikiText-103 training set) and at most 1.4% for LAMBADA.

Definitions used here:

* Words: ``str.lower()``, every character that is not a Unicode letter/digit/whitespace (regex
  ``[^\\w\\s]|_``) replaced by a space, split on whitespace (details and hashing in
  :mod:`mlm_eval.contamination.ngrams`). n-grams (``--n``, default 8) are consecutive words within
  one example or training document; examples shorter than ``n`` words have none.
* ``share``: contaminated n-gram positions / all n-gram positions of the eval set (an n-gram that
  repeats is counted each time it occurs). ``unique_share``: the same over distinct n-grams.
* Per example: the same ratio over the example's own n-gram positions.

Memory does not grow with the training corpus (see :mod:`mlm_eval.contamination.ngrams`), so a
corpus of millions of documents is a single streaming pass.

Example::

    mlm-eval contamination --train owt.jsonl wiki.jsonl --eval wikitext103 \\
        --data wikitext-103-raw/wiki.test.raw --n 8 --name gpt2-345m --json results/contam-wt103.json
    mlm-eval contamination --train data/corpus_text_document --tokenizer-type GPT2BPETokenizer \
        --vocab-file vocab.json --merge-file merges.txt --eval lambada --data lambada_test.jsonl
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from tqdm import tqdm

from mlm_eval.contamination.ngrams import EvalNgramSet, NgramHasher, TrainScanner
from mlm_eval.contamination.readers import EVAL_TASKS, iter_train_segments, read_eval_examples
from pretrain.tokenizer.factory import TokenizerConfig
from pretrain.tokenizer.flags import add_tokenizer_arguments
from pretrain.utils.errors import UserError
from pretrain.utils.outputs import check_writable_output
from pretrain.utils.results import make_result, write_result

NORMALISATION = "lower case; chars matching [^\\w\\s]|_ -> space; split on whitespace"


@dataclass(frozen=True, kw_only=True)
class ContaminationConfig:
    """Settings of one contamination scan."""

    train: tuple[Path, ...]
    eval_task: str
    data: Path
    n: int = 8
    top: int = 20
    train_text_key: str = "text"
    eval_text_key: str = "text"
    eval_id_key: str | None = None
    tokenizer: TokenizerConfig | None = None
    name: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.n < 1:
            raise UserError(f"--n must be >= 1, got {self.n}")
        if self.top < 0:
            raise UserError(f"--top must be >= 0, got {self.top}")
        if not self.train:
            raise UserError("--train: give at least one training corpus")
        if self.eval_task not in EVAL_TASKS:
            raise UserError(f"--eval: unknown task {self.eval_task!r} (choose from {', '.join(EVAL_TASKS)})")


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _scan(config: ContaminationConfig, hasher: NgramHasher, eval_set: EvalNgramSet) -> TrainScanner:
    scanner = TrainScanner(hasher, eval_set)
    for path in config.train:
        bar = tqdm(desc=f"scan {path.name}", unit="doc", disable=None if config.progress else True)
        for text, end in iter_train_segments(
            path, text_key=config.train_text_key, tokenizer=config.tokenizer
        ):
            scanner.feed(text, end_of_document=end)
            if end:
                bar.update(1)
        bar.close()
    scanner.finish()
    return scanner


def run_contamination(config: ContaminationConfig) -> dict[str, Any]:
    """Scan the training corpora and return a result record (``make_result`` schema, task ``contamination``).

    ``method`` is ``"<eval task>-<n>gram"`` (e.g. ``wikitext103-8gram``) so the leaderboard keeps the
    contamination of each eval set apart; ``metrics`` holds ``share``, ``unique_share`` (fractions),
    ``eval_ngrams`` and ``contaminated_ngrams``; corpus counts are in ``details``.

    ``details.examples`` lists every example in eval order as ``{"name", "ngrams", "contaminated",
    "share"}``; ``details.top`` the ``top`` most contaminated ones (highest share, then most
    contaminated n-grams, then eval order).
    """
    examples = read_eval_examples(
        config.eval_task, config.data, text_key=config.eval_text_key, id_key=config.eval_id_key
    )
    if not examples:
        raise UserError(f"--data {config.data}: no examples found")
    hasher = NgramHasher(config.n)
    eval_set = EvalNgramSet(hasher, [e.text for e in examples])
    scanner = _scan(config, hasher, eval_set)
    totals, hits = eval_set.example_counts()
    per_example = [
        {"name": e.name, "ngrams": int(t), "contaminated": int(h), "share": _ratio(int(h), int(t))}
        for e, t, h in zip(examples, totals, hits, strict=True)
    ]
    shares = [_ratio(int(h), int(t)) for t, h in zip(totals, hits, strict=True)]
    order = sorted(range(len(shares)), key=lambda i: (-shares[i], -int(hits[i]), i))
    total, contaminated = int(totals.sum()), int(hits.sum())
    metrics = {
        "share": _ratio(contaminated, total),
        "unique_share": _ratio(int(eval_set.seen.sum()), len(eval_set.unique)),
        "eval_ngrams": total,
        "contaminated_ngrams": contaminated,
    }
    details = {
        "eval_task": config.eval_task,
        "eval_data": str(config.data),
        "train": [str(p) for p in config.train],
        "n": config.n,
        "normalisation": NORMALISATION,
        "eval_unique_ngrams": len(eval_set.unique),
        "examples_count": len(examples),
        "train_documents": scanner.documents,
        "train_ngrams": scanner.ngrams,
        "top": [per_example[i] | {"index": i} for i in order[: config.top]],
        "examples": per_example,
    }
    name = config.name or "+".join(p.name for p in config.train)
    return make_result(
        kind="eval",
        task="contamination",
        method=f"{config.eval_task}-{config.n}gram",
        model={"name": name},
        metrics=metrics,
        details=details,
    )


def print_report(record: dict[str, Any], console: Console | None = None) -> None:
    """Print the overall share and the most contaminated examples as a table."""
    console = console or Console()
    metrics, details = record["metrics"], record["details"]
    table = Table(
        title=(
            f"{details['eval_task']}: {100 * metrics['share']:.2f}% of {metrics['eval_ngrams']} "
            f"{details['n']}-grams in training data ({100 * metrics['unique_share']:.2f}% of distinct)"
        )
    )
    for column, justify in (
        ("#", "right"),
        ("example", "left"),
        ("n-grams", "right"),
        ("found", "right"),
        ("share %", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in details["top"]:
        table.add_row(
            str(row["index"]),
            escape(row["name"]),
            str(row["ngrams"]),
            str(row["contaminated"]),
            f"{100 * row['share']:.2f}",
        )
    console.print(table)


def register(subparsers: Any) -> None:
    """Add the ``contamination`` subcommand to ``mlm-eval``."""
    parser = subparsers.add_parser(
        "contamination",
        help="share of eval n-grams found in training corpora",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--train",
        type=Path,
        nargs="+",
        required=True,
        help="training corpora: .jsonl, raw text, or .bin/.idx prefix",
    )
    parser.add_argument("--eval", dest="eval_task", choices=EVAL_TASKS, required=True, help="eval set format")
    parser.add_argument("--data", required=True, help="eval set file (or builtin:NAME, a packaged sample)")
    parser.add_argument(
        "--n", type=int, default=8, help="n-gram length in words (default 8, as in the paper)"
    )
    parser.add_argument("--top", type=int, default=20, help="most contaminated examples to list (default 20)")
    parser.add_argument("--out", "--json", dest="out", type=Path,
                        help="result JSON path (default: RESULTS_DIR/contamination-TASK-NAME.json)")  # fmt: skip
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where the result goes without --out (default: not written)")  # fmt: skip
    parser.add_argument("--train-text-key", default="text", help="text field of JSON-lines training corpora")
    parser.add_argument("--eval-text-key", default="text", help="text field for --eval jsonl")
    parser.add_argument("--eval-id-key", help="example name field for --eval jsonl")
    add_tokenizer_arguments(parser, required=False)  # to detokenize indexed datasets
    parser.add_argument(
        "--name",
        help="model or corpus the result is listed under (give the model's name to show contamination "
        "beside its scores in the leaderboard; default: the --train file names)",
    )
    parser.add_argument("--no-progress", "--quiet", dest="no_progress", action="store_true",
                        help="hide the progress bar")  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the subcommand from parsed arguments."""
    from mlm_eval.builtin import resolve_data_path
    from mlm_eval.tasks.data_sources import is_builtin

    if args.out is not None:
        check_writable_output(args.out, kind="file", flag="--out")
    elif args.results_dir is not None:
        check_writable_output(args.results_dir, kind="dir", flag="--results-dir", shared=True)
    config = ContaminationConfig(
        train=tuple(args.train),
        eval_task=args.eval_task,
        data=resolve_data_path(args.data),
        n=args.n,
        top=args.top,
        train_text_key=args.train_text_key,
        eval_text_key=args.eval_text_key,
        eval_id_key=args.eval_id_key,
        tokenizer=TokenizerConfig.from_args(args) if args.tokenizer_type else None,
        name=args.name,
        progress=not args.no_progress,
    )
    record = run_contamination(config)
    record["sample_data"] = is_builtin(args.data)
    record["units"] = {"share": "fraction", "unique_share": "fraction"}
    out = args.out
    if out is None and args.results_dir is not None:
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(record["model"]["name"]))
        out = Path(args.results_dir) / f"contamination-{record['method']}-{safe}.json"
    if out is not None:
        write_result(out, record)
    print_report(record)
    if out is not None:
        print(f"wrote {out}")
    return 0
