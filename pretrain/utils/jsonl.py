"""JSON-lines input with errors that name the file and line (``FILE:LINE: reason``).

Every command that reads JSON lines (eval sets, prompts, contamination corpora, hygiene inputs)
reads them here, so a malformed line is reported the same way everywhere and blank lines are
skipped the same way everywhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from pretrain.utils.errors import UserError

JsonObject = dict[str, object]


def parse_json_object(raw: bytes | str, *, source: str | os.PathLike[str], line: int) -> JsonObject:
    """One JSON line as an object; :class:`UserError` ``source:line: ...`` when it is not one."""
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{source}:{line}: not valid JSON ({exc})") from None
    if not isinstance(record, dict):
        raise UserError(f"{source}:{line}: expected a JSON object, got {type(record).__name__}")
    return record


def string_field(
    record: JsonObject, key: str, *, source: str | os.PathLike[str], line: int, hint: str = ""
) -> str:
    """``record[key]`` when it is a string; else :class:`UserError` naming the line and field.

    ``hint`` (for example ``"see --text-key"``) is appended in parentheses.
    """
    value = record.get(key)
    if not isinstance(value, str):
        suffix = f" ({hint})" if hint else ""
        raise UserError(f"{source}:{line}: field {key!r} missing or not a string{suffix}")
    return value


def iter_json_objects(
    path: str | os.PathLike[str], *, flag: str | None = None
) -> Iterator[tuple[int, JsonObject]]:
    """Yield ``(line_number, object)`` for every non-blank line of ``path`` (1-based numbers).

    A missing file is reported as ``FLAG: file not found: PATH`` (or ``PATH: file not found``);
    bad UTF-8 or JSON as ``PATH:LINE: reason``. The file is streamed, never read whole.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{flag}: file not found: {path}" if flag else f"{path}: file not found")
    try:
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh, start=1):
                if raw.strip():
                    yield number, parse_json_object(raw, source=path, line=number)
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
