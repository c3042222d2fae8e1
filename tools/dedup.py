"""``mlm-dedup``: near-duplicate removal over JSON-lines corpora with MinHash + LSH (paper sec. 4.1).

The paper removed documents with Jaccard similarity above 0.7 using locality-sensitive hashing.
Here each document's word shingles (see :mod:`tools.hygiene.shingles` for the normalisation) are
MinHashed with ``datasketch`` in ``--workers`` processes; the parent walks the documents in input
order and removes a document when some *earlier kept* document's estimated Jaccard similarity is
``>= --threshold``, otherwise keeps it (first occurrence wins). Exact duplicates have equal
signatures, so they are always removed. Kept lines are copied byte for byte as they are decided,
so memory holds signatures, never text (see :mod:`tools.hygiene.lsh_index` for the cost).

Threshold behaviour: the decision uses the MinHash estimate (standard error about
``sqrt(J(1-J)/num_perm)``, 0.04 at J = 0.7 with 128 permutations), and LSH may miss a pair whose
similarity is near the threshold (recall is about 92% at J = 0.7, 98% at 0.75, ~100% from 0.8 with
the defaults), so pairs within a few hundredths of the threshold can go either way; pairs well
above are removed and pairs well below are kept. Output is deterministic for a given ``--seed``.

Example::

    mlm-dedup --input corpus.jsonl --output dedup.jsonl --threshold 0.7 --workers 4
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.utils.errors import UserError, cli_entry
from tools.hygiene.jsonl import iter_raw_lines
from tools.hygiene.lsh_index import KeptIndex
from tools.hygiene.parallel import batched, ordered_map
from tools.hygiene.runner import run_hygiene_command, write_split
from tools.hygiene.shingles import ShingleConfig, signature_chunk


@dataclass(frozen=True, kw_only=True)
class DedupConfig:
    """Settings of one deduplication run."""

    input: Path
    output: Path
    report: Path
    threshold: float = 0.7
    shingle_size: int = 5
    num_perm: int = 128
    seed: int = 1
    text_key: str = "text"
    id_key: str | None = "id"
    workers: int = 1
    chunk_size: int = 256
    false_negative_weight: float = 0.9
    progress: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise UserError(f"--threshold must be in (0, 1], got {self.threshold}")
        if self.shingle_size < 1:
            raise UserError(f"--shingle-size must be >= 1, got {self.shingle_size}")
        if self.num_perm < 2:
            raise UserError(f"--num-perm must be >= 2, got {self.num_perm}")
        if self.workers < 1 or self.chunk_size < 1:
            raise UserError("--workers and --chunk-size must be >= 1")
        if not 0.0 <= self.false_negative_weight <= 1.0:
            raise UserError(f"--false-negative-weight must be in [0, 1], got {self.false_negative_weight}")
        if self.input.resolve() in (self.output.resolve(), self.report.resolve()):
            raise UserError(f"--output/--report must differ from --input {self.input}")


@dataclass(frozen=True, kw_only=True)
class DedupStats:
    """Counts of one run."""

    documents: int
    kept: int
    removed: int
    lsh_bands: int
    lsh_rows: int


def _signed_documents(config: DedupConfig) -> Iterator[tuple[int, bytes, np.ndarray, Any]]:
    """Yield ``(line, raw, signature, id)`` in input order, hashing in worker processes."""
    shingle_config = ShingleConfig(
        shingle_size=config.shingle_size,
        num_perm=config.num_perm,
        seed=config.seed,
        text_key=config.text_key,
        id_key=config.id_key,
        source=str(config.input),
    )
    fn = functools.partial(signature_chunk, config=shingle_config)
    chunks = batched(iter_raw_lines(config.input), config.chunk_size)
    for chunk, (sigs, ids) in ordered_map(fn, chunks, workers=config.workers):
        for (line, raw), sig, doc_id in zip(chunk, sigs, ids, strict=True):
            yield line, raw, sig, doc_id


def run_dedup(config: DedupConfig) -> DedupStats:
    """Write the kept documents to ``config.output`` and removed ones to ``config.report`` (atomically).

    Each report line is ``{"line", "id", "duplicate_of_line", "duplicate_of_id", "jaccard_estimate"}``
    (lines are 1-based line numbers of the input file; ids come from ``--id-key``, null if absent).
    """
    index = KeptIndex(
        threshold=config.threshold,
        num_perm=config.num_perm,
        seed=config.seed,
        weights=(1.0 - config.false_negative_weight, config.false_negative_weight),
    )
    counts = {"documents": 0, "removed": 0}

    def decisions() -> Iterator[tuple[bytes, dict[str, object] | None]]:
        for line, raw, sig, doc_id in _signed_documents(config):
            counts["documents"] += 1
            match = index.match(sig)
            if match is None:
                index.add(sig, line=line, doc_id=doc_id)
                yield raw, None
                continue
            counts["removed"] += 1
            yield (
                raw,
                {
                    "line": line,
                    "id": doc_id,
                    "duplicate_of_line": match.line,
                    "duplicate_of_id": match.doc_id,
                    "jaccard_estimate": round(match.jaccard, 6),
                },
            )

    write_split(config, decisions(), desc="dedup")
    documents, removed = counts["documents"], counts["removed"]
    bands, rows = index.bands
    return DedupStats(
        documents=documents, kept=documents - removed, removed=removed, lsh_bands=bands, lsh_rows=rows
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlm-dedup", description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True, help="JSON-lines corpus")
    parser.add_argument("--output", type=Path, required=True, help="kept documents (JSON lines)")
    parser.add_argument(
        "--report", type=Path, help="removed documents (default OUTPUT stem + .removed.jsonl)"
    )
    parser.add_argument("--summary", type=Path, help="also write the counts as JSON here")
    parser.add_argument("--threshold", type=float, default=0.7, help="Jaccard threshold (default 0.7)")
    parser.add_argument("--shingle-size", type=int, default=5, help="words per shingle (default 5)")
    parser.add_argument("--num-perm", type=int, default=128, help="MinHash permutations (default 128)")
    parser.add_argument("--seed", type=int, default=1, help="MinHash seed (default 1)")
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--id-key", default="id", help="document id field reported for duplicates")
    parser.add_argument("--workers", type=int, default=1, help="hashing processes")
    parser.add_argument("--chunk-size", type=int, default=256, help="documents per worker task")
    parser.add_argument(
        "--false-negative-weight",
        type=float,
        default=0.9,
        help="LSH band tuning weight on missed duplicates vs extra candidates (default 0.9)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar or table")
    return parser


def config_from_args(args: argparse.Namespace) -> DedupConfig:
    report = args.report or args.output.with_name(args.output.stem + ".removed.jsonl")
    return DedupConfig(
        input=args.input,
        output=args.output,
        report=report,
        threshold=args.threshold,
        shingle_size=args.shingle_size,
        num_perm=args.num_perm,
        seed=args.seed,
        text_key=args.text_key,
        id_key=args.id_key or None,
        workers=args.workers,
        chunk_size=args.chunk_size,
        false_negative_weight=args.false_negative_weight,
        progress=not args.quiet,
    )


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    run_hygiene_command(
        config,
        run_dedup,
        summary=args.summary,
        quiet=args.quiet,
        title=f"mlm-dedup {config.input} (threshold {config.threshold})",
        columns={
            "documents": lambda s: s.documents,
            "kept": lambda s: s.kept,
            "removed": lambda s: s.removed,
            "removed %": lambda s: f"{100.0 * s.removed / s.documents if s.documents else 0.0:.2f}",
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
