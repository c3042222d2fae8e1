"""BERT WordPiece (``vocab.txt``, one token per line), lower-cased or cased, via ``tokenizers``.

Same ids as Megatron's ``BertWordPieceLowerCase`` / ``BertWordPieceCase``: lower-casing also
strips accents (as BERT uncased); ``vocab_size`` is the number of lines of ``vocab.txt``. The
vocabulary must contain ``[CLS]``, ``[SEP]``, ``[PAD]``, ``[MASK]`` and ``[UNK]``. BERT has no
end-of-document token: :attr:`eod` is ``None``. ``detokenize`` joins word pieces (``##``) and
cleans up spaces before punctuation, so it is not an exact inverse (case and accents may be lost).
"""

from __future__ import annotations

import os

from pretrain.tokenizer.base import TokenizersBacked, require_file
from pretrain.utils.errors import UserError

REQUIRED_TOKENS = ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]")


class BertWordPieceTokenizer(TokenizersBacked):
    def __init__(
        self, vocab_file: str | os.PathLike[str], *, lower_case: bool = True, vocab_flag: str = "--vocab-file"
    ) -> None:
        from tokenizers import BertWordPieceTokenizer as _HFWordPiece

        path = require_file(vocab_file, vocab_flag, "BERT vocab.txt")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise UserError(f"{vocab_flag} {path}: not UTF-8 text ({exc})") from None
        vocab: dict[str, int] = {}
        for i, line in enumerate(lines):
            token = line.rstrip("\r\n")
            if token.strip() == "":
                raise UserError(f"{vocab_flag} {path}:{i + 1}: empty token line in BERT vocab.txt")
            vocab[token] = i  # a repeated token keeps its last id, as in BERT's loader
        missing = [t for t in REQUIRED_TOKENS if t not in vocab]
        if missing:
            raise UserError(f"{vocab_flag} {path}: BERT vocab.txt lacks special tokens {', '.join(missing)}")
        try:
            self._tok = _HFWordPiece(
                str(path), lowercase=lower_case, strip_accents=None if lower_case else False
            )
        except Exception as exc:  # the Rust library raises plain Exception
            raise UserError(f"{vocab_flag} {path}: cannot load BERT WordPiece vocabulary ({exc})") from None
        self.lower_case = lower_case
        self.tokenizer_type = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        self.vocab_file = str(path)
        self._vocab_size = len(lines)
        self._cls, self._sep, self._pad, self._mask = (vocab[t] for t in REQUIRED_TOKENS[:4])
