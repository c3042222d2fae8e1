"""A tiny built-in English corpus for the demo and the tests (generated from templates, no downloads).

``corpus.jsonl`` holds ~300 short documents, one JSON object ``{"text": ...}`` per line. It is
generated deterministically by :func:`generate_corpus` (``python -m pretrain.data.builtin.generate``
rewrites the file); every sentence comes from templates written for this project.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["builtin_corpus_path"]


def builtin_corpus_path() -> Path:
    """Path of the shipped ``corpus.jsonl`` (JSON lines with key ``text``)."""
    return Path(__file__).with_name("corpus.jsonl")
