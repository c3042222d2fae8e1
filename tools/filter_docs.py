"""``mlm-filter``: drop short documents and excluded articles from a JSON-lines corpus (paper sec. 4.1).

The paper removed documents shorter than 128 tokens and the Wikipedia articles present in the
WikiText-103 test set. Two independent filters, applied in this order:

1. ``--exclude-titles FILE``: drop documents whose title matches the list (the matching rule, and
   how a document's title is found, are in :mod:`tools.hygiene.titles`).
2. ``--min-tokens N`` (default off; the paper used 128): drop documents with fewer than ``N``
   tokens, counted as whitespace-separated words, or as the tokens of the Hugging Face tokenizer
   in ``--tokenizer-dir`` (no special tokens added).

A document dropped by both is counted once, under the first. Kept lines are copied byte for byte,
streaming; the output and the report of dropped documents (JSON lines ``{"line", "id", "reason",
"tokens"|"title"}``) are written atomically, and the counts are printed as a table (and written
as JSON with ``--summary``).

Example::

    mlm-filter --input corpus.jsonl --output filtered.jsonl --min-tokens 128 \\
        --tokenizer-dir gpt2-tokenizer/ --exclude-titles wikitext-103-raw/wiki.test.raw
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pretrain.utils.errors import UserError, cli_entry
from tools.hygiene.jsonl import Document, iter_raw_lines, parse_document
from tools.hygiene.parallel import batched
from tools.hygiene.runner import run_hygiene_command, write_split
from tools.hygiene.titles import document_title, load_exclusions, title_key
from tools.hygiene.token_count import TokenCounter, tokenizer_counter, whitespace_counts


@dataclass(frozen=True, kw_only=True)
class FilterConfig:
    """Settings of one filtering run."""

    input: Path
    output: Path
    report: Path
    min_tokens: int = 0
    tokenizer_dir: Path | None = None
    exclude_titles: Path | None = None
    text_key: str = "text"
    id_key: str | None = "id"
    title_key: str | None = "title"
    first_line_title: bool = False
    batch_size: int = 512
    progress: bool = True

    def __post_init__(self) -> None:
        if self.min_tokens < 0:
            raise UserError(f"--min-tokens must be >= 0, got {self.min_tokens}")
        if self.batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.input.resolve() in (self.output.resolve(), self.report.resolve()):
            raise UserError(f"--output/--report must differ from --input {self.input}")


@dataclass(frozen=True, kw_only=True)
class FilterStats:
    """Counts of one run."""

    documents: int
    kept: int
    removed_excluded: int
    removed_short: int


def _counter(config: FilterConfig) -> TokenCounter | None:
    if config.min_tokens == 0:
        return None
    return whitespace_counts if config.tokenizer_dir is None else tokenizer_counter(config.tokenizer_dir)


def _drop_reason(
    doc: Document, tokens: int, config: FilterConfig, exclusions: frozenset[str]
) -> dict[str, object] | None:
    """The report record of a dropped document (title filter first), or None to keep it."""
    if exclusions:
        title = document_title(doc.text, doc.title, first_line=config.first_line_title)
        if title is not None and title_key(title) in exclusions:
            return {"line": doc.line, "id": doc.doc_id, "reason": "excluded", "title": title}
    if tokens < config.min_tokens:
        return {"line": doc.line, "id": doc.doc_id, "reason": "short", "tokens": tokens}
    return None


def run_filter(config: FilterConfig) -> FilterStats:
    """Write kept documents to ``config.output`` and dropped ones to ``config.report`` (atomically)."""
    exclusions = load_exclusions(config.exclude_titles) if config.exclude_titles else frozenset()
    counter = _counter(config)
    counts = {"documents": 0, "excluded": 0, "short": 0}

    def decisions() -> Iterator[tuple[bytes, dict[str, object] | None]]:
        for batch in batched(iter_raw_lines(config.input), config.batch_size):
            docs = [parse_document(raw, line=line, source=str(config.input), text_key=config.text_key,
                                   id_key=config.id_key, title_key=config.title_key)
                    for line, raw in batch]  # fmt: skip
            tokens = counter([d.text for d in docs]) if counter else [0] * len(docs)
            for (_, raw), doc, n_tokens in zip(batch, docs, tokens, strict=True):
                counts["documents"] += 1
                reason = _drop_reason(doc, n_tokens, config, exclusions)
                if reason is not None:
                    counts[str(reason["reason"])] += 1
                yield raw, reason

    write_split(config, decisions(), desc="filter")
    documents, excluded, short = counts["documents"], counts["excluded"], counts["short"]
    return FilterStats(
        documents=documents, kept=documents - excluded - short, removed_excluded=excluded, removed_short=short
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlm-filter", description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True, help="JSON-lines corpus")
    parser.add_argument("--output", type=Path, required=True, help="kept documents (JSON lines)")
    parser.add_argument(
        "--report", type=Path, help="dropped documents (default OUTPUT stem + .dropped.jsonl)"
    )
    parser.add_argument("--summary", type=Path, help="also write the counts as JSON here")
    parser.add_argument(
        "--min-tokens", type=int, default=0, help="drop documents shorter than this (0 = off; paper: 128)"
    )
    parser.add_argument("--tokenizer-dir", type=Path, help="count tokens with this Hugging Face tokenizer")
    parser.add_argument(
        "--exclude-titles", type=Path, help="file of titles (or WikiText '= Title =' headings)"
    )
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--id-key", default="id", help="document id field copied into the report")
    parser.add_argument("--title-key", default="title", help="document title field")
    parser.add_argument(
        "--first-line-title", action="store_true", help="use a text's first line as its title"
    )
    parser.add_argument("--batch-size", type=int, default=512, help="documents per tokenizer batch")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or table")
    return parser


def config_from_args(args: argparse.Namespace) -> FilterConfig:
    if args.min_tokens == 0 and args.exclude_titles is None:
        raise UserError("nothing to do: give --min-tokens N and/or --exclude-titles FILE")
    return FilterConfig(
        input=args.input,
        output=args.output,
        report=args.report or args.output.with_name(args.output.stem + ".dropped.jsonl"),
        min_tokens=args.min_tokens,
        tokenizer_dir=args.tokenizer_dir,
        exclude_titles=args.exclude_titles,
        text_key=args.text_key,
        id_key=args.id_key or None,
        title_key=args.title_key or None,
        first_line_title=args.first_line_title,
        batch_size=args.batch_size,
        progress=not args.quiet,
    )


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    run_hygiene_command(
        config,
        run_filter,
        summary=args.summary,
        quiet=args.quiet,
        title=f"mlm-filter {config.input}",
        columns={
            "documents": lambda s: s.documents,
            "kept": lambda s: s.kept,
            "excluded titles": lambda s: s.removed_excluded,
            f"< {config.min_tokens} tokens": lambda s: s.removed_short,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
