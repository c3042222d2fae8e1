"""Reading JSON-lines corpora one raw line at a time, with errors that name the file and line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.utils.errors import UserError
from pretrain.utils.jsonl import parse_json_object, string_field


@dataclass(frozen=True, kw_only=True)
class Document:
    """One parsed JSON-lines document: its 1-based line number, text, id and title (if any)."""

    line: int
    text: str
    doc_id: Any = None
    title: str | None = None


def iter_raw_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Yield ``(line_number, raw_line)`` for every non-blank line; bytes so they can be copied verbatim."""
    if not path.is_file():
        raise UserError(f"{path}: input file not found")
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if raw.strip():
                yield number, raw


def parse_document(
    raw: bytes | str,
    *,
    line: int,
    source: str,
    text_key: str,
    id_key: str | None = None,
    title_key: str | None = None,
) -> Document:
    """Parse one JSON line; raise :class:`UserError` naming ``source:line`` and the field when it is bad."""
    record = parse_json_object(raw, source=source, line=line)
    text = string_field(record, text_key, source=source, line=line, hint="see --text-key")
    title = record.get(title_key) if title_key else None
    return Document(
        line=line,
        text=text,
        doc_id=record.get(id_key) if id_key else None,
        title=title if isinstance(title, str) else None,
    )


def write_summary(path: str | os.PathLike[str], stats: Any, report: str | os.PathLike[str]) -> None:
    """Write a run's counters (a dataclass) and its report path as JSON, atomically."""
    import dataclasses

    from pretrain.utils.atomic import atomic_open

    with atomic_open(path, "w", encoding="utf-8") as fh:
        json.dump({**dataclasses.asdict(stats), "report": str(report)}, fh, indent=2)
        fh.write("\n")
