"""The runner shared by ``mlm-dedup`` and ``mlm-filter``: split a JSON-lines corpus into kept lines
and a report of removed ones, streaming, with a progress bar, atomic outputs and a summary."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol, TypeVar

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from pretrain.utils.atomic import atomic_open
from pretrain.utils.outputs import check_writable_output
from tools.hygiene.jsonl import write_summary


class CorpusSplit(Protocol):
    """What both commands' configs carry: where the corpus comes from and where its halves go."""

    @property
    def input(self) -> Path: ...
    @property
    def output(self) -> Path: ...
    @property
    def report(self) -> Path: ...
    @property
    def progress(self) -> bool: ...


def write_split(config: CorpusSplit, decisions: Iterable[tuple[bytes, Mapping[str, object] | None]], *,
                desc: str) -> None:  # fmt: skip
    """Copy each kept raw line to ``config.output`` byte for byte and each removal record (a JSON
    object) to ``config.report``, in input order; both files are written atomically.

    ``decisions`` yields ``(raw_line, None)`` to keep a line and ``(raw_line, record)`` to remove it.
    The bar counts input bytes and shows only on a terminal (or never with ``progress=False``).
    """
    bar = tqdm(total=config.input.stat().st_size if config.input.is_file() else None, unit="B",
               unit_scale=True, desc=desc, disable=None if config.progress else True)  # fmt: skip
    with atomic_open(config.output, "wb") as out, atomic_open(config.report, "w", encoding="utf-8") as rep:
        for raw, record in decisions:
            bar.update(len(raw))
            if record is None:
                out.write(raw if raw.endswith(b"\n") else raw + b"\n")
            else:
                rep.write(json.dumps(record, ensure_ascii=False) + "\n")
    bar.close()


S = TypeVar("S")
C = TypeVar("C", bound=CorpusSplit)


def run_hygiene_command(config: C, run: Callable[[C], S], *, summary: Path | None, quiet: bool,
                        title: str, columns: Mapping[str, Callable[[S], object]]) -> S:  # fmt: skip
    """Check every output before any work, run, write ``--summary`` JSON and print the counts table.

    ``columns`` maps a table column to how its cell is read off the run's stats.
    """
    check_writable_output(config.output, kind="file", flag="--output")
    check_writable_output(config.report, kind="file", flag="--report")
    if summary:
        check_writable_output(summary, kind="file", flag="--summary")
    stats = run(config)
    if summary:
        write_summary(summary, stats, config.report)
    if not quiet:
        table = Table(title=title)
        for column in columns:
            table.add_column(column, justify="right")
        table.add_row(*(str(cell(stats)) for cell in columns.values()))
        Console(stderr=True).print(table)
    return stats
