"""Counting a document's tokens: whitespace words, or a Hugging Face tokenizer's tokens."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from pretrain.utils.errors import UserError

TokenCounter = Callable[[list[str]], list[int]]


def whitespace_counts(texts: list[str]) -> list[int]:
    """Number of whitespace-separated words of each text."""
    return [len(text.split()) for text in texts]


def tokenizer_counter(tokenizer_dir: Path) -> TokenCounter:
    """A batch counter using the tokenizer saved in ``tokenizer_dir`` (no special tokens added)."""
    if not tokenizer_dir.is_dir():
        raise UserError(f"--tokenizer-dir: not a directory: {tokenizer_dir}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory never needs the hub
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"--tokenizer-dir {tokenizer_dir}: cannot load a tokenizer ({exc})") from None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The Rust tokenizer batches in parallel and skips the model_max_length warning.
        def fast(texts: list[str]) -> list[int]:
            return [len(enc.ids) for enc in backend.encode_batch(texts, add_special_tokens=False)]

        return fast

    def slow(texts: list[str]) -> list[int]:
        return [len(tokenizer.encode(text, add_special_tokens=False)) for text in texts]

    return slow
