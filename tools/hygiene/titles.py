"""Exclusion lists of article titles (e.g. the WikiText-103 test articles, paper sec. 4.1).

Matching rule:

* A title is normalised to its *key*: Unicode NFKC, case-folded, keeping only letters and digits
  (all spaces, punctuation and WikiText's ``@-@`` style markers dropped). So ``Kiss You ( One
  Direction song )`` (WikiText tokenisation) and ``Kiss You (One Direction song)`` (Wikipedia)
  match, and so do ``Nine @-@ inch`` and ``Nine-inch``. Titles whose key is empty are ignored.
* An exclusion file lists titles one per line. When the file contains level-1 WikiText headings
  (lines ``= Title =``, not ``= = Section = =``), only those headings are read, so the raw
  WikiText-103 test file itself can be given; otherwise every non-blank line is a title (an
  optional ``= ... =`` wrapper is removed).
* A document's title is its ``--title-key`` JSON field when present; otherwise, when the first
  non-blank line of its text is a level-1 heading ``= Title =``, that heading; otherwise (only
  with ``--first-line-title``) the first non-blank line of its text.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from pretrain.utils.errors import UserError
from pretrain.utils.text import read_utf8

_HEADING = re.compile(r"^\s*=\s+(?!=)(.*?)\s+=\s*$")


def title_key(title: str) -> str:
    """The normalised matching key of a title (see the module docstring)."""
    return "".join(ch for ch in unicodedata.normalize("NFKC", title).casefold() if ch.isalnum())


def heading_title(line: str) -> str | None:
    """The title of a level-1 WikiText heading line ``= Title =``, else None."""
    match = _HEADING.match(line)
    if match is None or match.group(1).startswith("=") or match.group(1).endswith("="):
        return None
    return match.group(1)


def load_exclusions(path: Path) -> frozenset[str]:
    """Read an exclusion file into a set of title keys."""
    if not path.is_file():
        raise UserError(f"--exclude-titles: file not found: {path}")
    lines = [
        line.rstrip("\r") for line in read_utf8(path, what="--exclude-titles").split("\n") if line.strip()
    ]
    headings = [t for t in (heading_title(line) for line in lines) if t is not None]
    titles = headings if headings else lines
    keys = frozenset(k for k in (title_key(t) for t in titles) if k)
    if not keys:
        raise UserError(f"--exclude-titles: no titles found in {path}")
    return keys


def document_title(text: str, json_title: str | None, *, first_line: bool) -> str | None:
    """A document's title by the rule in the module docstring, or None."""
    if json_title is not None:
        return json_title
    for line in text.splitlines():
        if line.strip():
            heading = heading_title(line)
            if heading is not None:
                return heading
            return line.strip() if first_line else None
    return None
