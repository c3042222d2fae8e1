"""Test helper: a tiny real WordPiece tokenizer trained on the test's own texts (no downloads)."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import BertWordPieceTokenizer, Tokenizer

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def tiny_wordpiece(texts: Iterable[str], *, vocab_size: int = 300) -> Tokenizer:
    """A lower-casing BERT WordPiece tokenizer; a small vocabulary splits words into ``##`` pieces."""
    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(
        list(texts), vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIALS, show_progress=False
    )
    return wp._tokenizer
