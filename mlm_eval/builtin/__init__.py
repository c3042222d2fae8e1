"""Small built-in sample data for demos and smoke tests (written for this project, no third-party text).

- ``wikitext_sample.tokens``: WikiText-103 raw format (`` = Title = `` headings, `` @-@ ``, `` @,@ ``,
  `` @.@ ``, ``<unk>``, spaced punctuation).
- ``lambada_sample.jsonl``: LAMBADA format, one ``{"text": ...}`` per line, each ending in its target word.

Command-line ``--data builtin:NAME`` resolves through :func:`resolve_data_path`.
"""

from __future__ import annotations

from pathlib import Path

from pretrain.utils.errors import UserError

BUILTIN_PREFIX = "builtin:"


def builtin_path(name: str) -> Path:
    """Path of the built-in data file ``name`` (e.g. ``"lambada_sample.jsonl"``)."""
    path = Path(__file__).resolve().parent / name
    if name.startswith((".", "_")) or "/" in name or not path.is_file():
        known = ", ".join(sorted(p.name for p in path.parent.iterdir() if p.suffix in {".tokens", ".jsonl"}))
        raise UserError(f"no built-in data named {name!r} (available: {known})")
    return path


def resolve_data_path(value: str) -> Path:
    """``builtin:NAME`` to the packaged file, anything else to a plain path (checked later)."""
    if value.startswith(BUILTIN_PREFIX):
        return builtin_path(value[len(BUILTIN_PREFIX) :])
    return Path(value)
