"""mlm-preprocess: tokenize text into Megatron indexed datasets (``.bin`` + ``.idx``).

Usage (flags as Megatron's ``tools/preprocess_data.py``)::

    mlm-preprocess --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 4
    # -> data/corpus_text_document.bin / .idx   (use --data-path data/corpus_text_document)

    mlm-preprocess --input wiki.jsonl --output-prefix data/wiki --json-keys text \\
        --tokenizer-type BertWordPieceLowerCase --vocab-file vocab.txt --split-sentences
    # -> data/wiki_text_sentence.bin / .idx     (one sequence per sentence, grouped by document)

Input (``--input``, one or more files; ``--input-format`` overrides the choice by file name):

* ``.jsonl`` / ``.json`` / ``.ndjson`` files are JSON lines: one JSON object per line, the text
  under ``--json-keys`` (default ``text``). Several keys give one dataset each,
  ``PREFIX_KEY_document`` (``PREFIX_KEY_sentence`` with ``--split-sentences``), aligned document
  by document. Blank lines are ignored.
* anything else is plain text, one document per line (``--input-format text``); with
  ``--input-format text-blocks`` documents are separated by blank lines and keep their inner
  newlines. Blank lines are never documents. The single ``--json-keys`` value names the output.

Every input record becomes one document, in input order, whatever ``--workers`` is (the output is
byte-identical for any number of workers). A record whose text tokenizes to nothing becomes an
empty document (as Megatron), so document ``i`` is always the ``i``-th (well-formed) record. ``--append-eod``
appends the tokenizer's end-of-document id to each non-empty document. ``--split-sentences``
cuts documents into sentences with a small built-in rule (a ``.``, ``!`` or ``?`` (+ closing
quotes/brackets) followed by whitespace and a capital letter, digit or opening quote, except after
common abbreviations and initials; blank lines always end a sentence); it does not use nltk, so
results do not depend on what is installed. Newlines inside a sentence are kept (Megatron's
``--keep-newlines`` is accepted and has nothing more to do).

Token ids are stored as uint16 when the vocabulary has fewer than 65500 entries, else int32.
``--workers N`` tokenizes in N processes (``spawn``); a progress bar over input bytes shows on a
terminal, otherwise a line every ``--log-interval`` documents goes to stderr.

Malformed records (invalid UTF-8, invalid JSON, not an object, a missing or non-string key) stop
the run with ``error: FILE:LINE: reason`` and exit status 2; nothing is written (outputs appear
only at the very end, by atomic rename, so an earlier dataset at the same prefix is kept intact).
``--skip-bad-lines`` reports each such line as a warning, skips it and counts it instead. The run
ends with a one-line summary on stdout: documents, tokens, skipped lines and the outputs.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.data.indexed_dataset import optimal_dtype
from pretrain.data.indexed_dataset_builder import IndexedDatasetBuilder
from pretrain.tokenizer.factory import TokenizerConfig, build_tokenizer
from pretrain.tokenizer.flags import add_tokenizer_arguments
from pretrain.utils.errors import UserError, cli_entry
from pretrain.utils.outputs import check_writable_output
from tools.preprocess_records import (
    INPUT_FORMATS,
    EncodeSpec,
    encode_job,
    format_of,
    init_worker,
    read_records,
)

_MAX_WARNINGS = 20


# --------------------------------------------------------------------------------------------- CLI


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlm-preprocess",
        description="Tokenize JSON lines or plain text into Megatron indexed datasets (.bin + .idx).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True, help="input file(s): JSON lines or plain text")
    g.add_argument(
        "--input-format",
        choices=INPUT_FORMATS,
        default="auto",
        help="auto: .jsonl/.json/.ndjson are JSON lines, other files plain text with one document per line",
    )
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract; one dataset per key")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (for BERT)")
    g.add_argument(
        "--keep-newlines", action="store_true", help=argparse.SUPPRESS
    )  # accepted for compatibility
    g.add_argument(
        "--skip-bad-lines", action="store_true", help="skip and count malformed lines instead of failing"
    )
    add_tokenizer_arguments(p)
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_KEY_document.bin/.idx per key")
    g.add_argument("--dataset-impl", choices=["mmap"], default="mmap", help="only Megatron's mmap format")
    g.add_argument(
        "--append-eod", action="store_true", help="append the end-of-document token to each document"
    )
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--log-interval", type=int, default=100, help="documents between progress reports")
    return p


def _check_args(args: argparse.Namespace) -> tuple[list[Path], list[str]]:
    if args.workers < 1:
        raise UserError(f"--workers must be at least 1, got {args.workers}")
    if args.log_interval < 1:
        raise UserError(f"--log-interval must be at least 1, got {args.log_interval}")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise UserError(f"--json-keys has duplicates: {' '.join(args.json_keys)}")
    for key in args.json_keys:
        if not key or "/" in key or key.startswith("."):
            raise UserError(f"--json-keys {key!r}: a key must be a non-empty name usable in a file name")
    paths = [Path(p) for p in args.input]
    formats = []
    for path in paths:
        if not path.is_file():
            raise UserError(f"--input {path}: file not found")
        fmt = format_of(path, args.input_format)
        if fmt != "jsonl" and len(args.json_keys) != 1:
            raise UserError(
                f"--input {path}: plain text has one field, but --json-keys names {len(args.json_keys)}"
            )
        formats.append(fmt)
    out_dir = Path(args.output_prefix).parent
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--output-prefix {args.output_prefix}: {out_dir} is not a directory")
    check_writable_output(f"{args.output_prefix}_{args.json_keys[0]}_document.bin", kind="file",
                          flag="--output-prefix")  # fmt: skip
    return paths, formats


class _Progress:
    """tqdm bar over input bytes on a terminal; plain log lines every ``interval`` documents otherwise."""

    def __init__(self, total_bytes: int, interval: int) -> None:
        from tqdm import tqdm

        self.interval = interval
        self.start = time.monotonic()
        self.docs = 0
        self.bytes = 0
        self.bar = tqdm(
            total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=None, file=sys.stderr
        )
        self.plain = bool(self.bar.disable)

    def update(self, nbytes: int) -> None:
        self.docs += 1
        self.bytes += nbytes
        self.bar.update(nbytes)
        if self.plain and self.docs % self.interval == 0:
            elapsed = max(time.monotonic() - self.start, 1e-9)
            print(
                f"processed {self.docs} documents ({self.docs / elapsed:.1f} docs/s, "
                f"{self.bytes / elapsed / 1e6:.2f} MB/s)",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()


@dataclass
class _Counts:
    """What one run did (printed at the end)."""

    docs: int = 0
    tokens: int = 0
    empty: int = 0
    skipped: int = 0


@contextlib.contextmanager
def _encoded(
    records: Iterator[Any], spec: EncodeSpec, workers: int
) -> Iterator[Iterator[tuple[int, int, int, Any]]]:
    """``(file number, line, bytes, per-key (tokens, lengths) or a reason)`` per record, in input
    order, encoded in ``workers`` spawned processes (in this one for 1); the pool ends with the block."""
    if workers == 1:
        init_worker(spec)
        yield map(encode_job, records)
        return
    pool = multiprocessing.get_context("spawn").Pool(workers, initializer=init_worker, initargs=(spec,))
    try:
        yield pool.imap(encode_job, records, chunksize=32)
    finally:
        pool.terminate()
        pool.join()


def _skip(where: str, reason: str, counts: _Counts, progress: _Progress, *, skip_bad_lines: bool) -> None:
    """A bad line: one error line, or (``--skip-bad-lines``) counted with a bounded number of warnings."""
    if not skip_bad_lines:
        raise UserError(f"{where}: {reason} (use --skip-bad-lines to skip such lines)")
    counts.skipped += 1
    if counts.skipped <= _MAX_WARNINGS:
        progress.bar.write(f"warning: {where}: {reason} (skipped)", file=sys.stderr)
    elif counts.skipped == _MAX_WARNINGS + 1:
        progress.bar.write("warning: more bad lines skipped; see the count at the end", file=sys.stderr)


def _fill(builders: list[IndexedDatasetBuilder], results: Iterator[tuple[int, int, int, Any]],
          paths: list[Path], progress: _Progress, *, skip_bad_lines: bool) -> _Counts:  # fmt: skip
    """Add every encoded document to the builders (one per JSON key)."""
    counts = _Counts()
    for file_no, lineno, nbytes, result in results:
        progress.update(nbytes)
        if isinstance(result, str):
            _skip(f"{paths[file_no]}:{lineno}", result, counts, progress, skip_bad_lines=skip_bad_lines)
            continue
        counts.docs += 1
        counts.empty += all(flat.size == 0 for flat, _ in result)
        for builder, (flat, lengths) in zip(builders, result, strict=True):
            builder.add_document(flat, lengths)
            counts.tokens += int(flat.size)
    if counts.docs == 0:
        raise UserError(
            f"--input {' '.join(map(str, paths))}: no documents"
            + (f" ({counts.skipped} bad lines skipped)" if counts.skipped else "")
        )
    return counts


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = get_parser().parse_args(argv)
    paths, formats = _check_args(args)
    tok_cfg = TokenizerConfig.from_args(args)
    tokenizer = build_tokenizer(tok_cfg)
    if args.append_eod and tokenizer.eod is None:
        raise UserError(f"--append-eod: tokenizer {tok_cfg.tokenizer_type} has no end-of-document token")
    spec = EncodeSpec(tok_cfg, tuple(args.json_keys), bool(args.split_sentences), bool(args.append_eod))
    level = "sentence" if args.split_sentences else "document"
    dtype = optimal_dtype(tokenizer.vocab_size)
    prefixes = [f"{args.output_prefix}_{key}_{level}" for key in args.json_keys]
    out_dir = Path(args.output_prefix).absolute().parent
    missing_dirs = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # removed again on failure
    progress = _Progress(sum(p.stat().st_size for p in paths), args.log_interval)
    builders: list[IndexedDatasetBuilder] = []
    committed = False
    try:
        builders = [IndexedDatasetBuilder(prefix, dtype=dtype) for prefix in prefixes]
        with _encoded(read_records(paths, formats), spec, args.workers) as results:
            counts = _fill(builders, results, paths, progress, skip_bad_lines=args.skip_bad_lines)
        for builder in builders:
            builder.close()
        outputs = [builder.commit() for builder in builders]
        committed = True
    finally:
        progress.close()
        if not committed:
            for builder in builders:
                builder.abort()
            for d in missing_dirs:
                with contextlib.suppress(OSError):
                    d.rmdir()  # only if still empty
    names = ", ".join(f"{os.path.splitext(b)[0]}.{{bin,idx}}" for b, _ in outputs)
    empty = f" ({counts.empty} empty)" if counts.empty else ""
    print(f"mlm-preprocess: {counts.docs} documents{empty}, {counts.tokens} tokens, "
          f"{counts.skipped} bad lines skipped -> {names}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
