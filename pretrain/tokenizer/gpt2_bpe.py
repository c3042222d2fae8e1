"""GPT-2 byte-level BPE (``vocab.json`` + ``merges.txt``), via the ``tokenizers`` library.

Same ids as Megatron's ``GPT2BPETokenizer``: ``vocab_size`` is the size of ``vocab.json`` (50257
for GPT-2) and ``eod`` is ``<|endoftext|>``. The text ``<|endoftext|>`` inside a document is *not*
turned into the eod id (it is tokenized as ordinary text), so documents cannot forge boundaries.
Byte-level BPE is lossless: ``detokenize(tokenize(text)) == text`` for every string.
"""

from __future__ import annotations

import json
import os

from pretrain.tokenizer.base import TokenizersBacked, require_file
from pretrain.utils.errors import UserError

EOD_TOKEN = "<|endoftext|>"


class GPT2BPETokenizer(TokenizersBacked):
    tokenizer_type = "GPT2BPETokenizer"

    def __init__(
        self,
        vocab_file: str | os.PathLike[str],
        merge_file: str | os.PathLike[str],
        *,
        vocab_flag: str = "--vocab-file",
        merge_flag: str = "--merge-file",
    ) -> None:
        from tokenizers import ByteLevelBPETokenizer

        vocab_path = require_file(vocab_file, vocab_flag, "GPT-2 vocab.json")
        merge_path = require_file(merge_file, merge_flag, "GPT-2 merges.txt")
        try:
            vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"{vocab_flag} {vocab_path}: not a JSON vocabulary ({exc})") from None
        if (
            not isinstance(vocab, dict)
            or not vocab
            or not all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in vocab.items())
        ):
            raise UserError(
                f"{vocab_flag} {vocab_path}: expected a JSON object mapping tokens to non-negative ids"
            )
        try:
            merge_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(f"{merge_flag} {merge_path}: not UTF-8 text ({exc})") from None
        try:
            self._tok = ByteLevelBPETokenizer(str(vocab_path), str(merge_path), add_prefix_space=False)
        except Exception as exc:  # the Rust library raises plain Exception
            raise UserError(
                f"{vocab_flag} {vocab_path} / {merge_flag} {merge_path}: cannot load GPT-2 BPE ({exc})"
            ) from None
        self._vocab_size = max(len(vocab), max(vocab.values()) + 1)
        self._eod = vocab.get(EOD_TOKEN)
        self.vocab_file = str(vocab_path)
        self.merge_file = str(merge_path)
