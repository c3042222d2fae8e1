"""The one small tokenizer interface every model, dataset and tool uses."""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pretrain.utils.errors import UserError


class Tokenizer(abc.ABC):
    # Special ids: subclasses set ``_eod``, ``_cls``, ``_sep``, ``_pad``, ``_mask`` (or override).
    """Text <-> token ids, plus the ids of the special tokens (``None`` where a vocabulary has none).

    ``tokenize`` never adds special tokens (no BOS/CLS/SEP/EOD): callers append what they need, e.g.
    ``mlm-preprocess --append-eod`` appends :attr:`eod` after each document.
    """

    #: Megatron's name of the tokenizer type (``--tokenizer-type``).
    tokenizer_type: str = ""
    #: The tokenizer's own convention puts :attr:`bos` before a document (Llama's SentencePiece
    #: and ``add_bos_token`` Hugging Face tokenizers; GPT-2 does not). ``tokenize`` never adds it.
    adds_bos: bool = False

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""

    @abc.abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; exact inverse of :meth:`tokenize` for byte-level BPE."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids (every id produced is ``< vocab_size``), before any padding for TP."""

    @property
    def bos(self) -> int | None:
        """Beginning-of-sequence id; ``None`` if absent."""
        return getattr(self, "_bos", None)

    @property
    def eod(self) -> int | None:
        """End-of-document id appended between documents (GPT); ``None`` if absent."""
        return getattr(self, "_eod", None)

    @property
    def cls(self) -> int | None:
        return getattr(self, "_cls", None)

    @property
    def sep(self) -> int | None:
        return getattr(self, "_sep", None)

    @property
    def pad(self) -> int | None:
        return getattr(self, "_pad", None)

    @property
    def mask(self) -> int | None:
        return getattr(self, "_mask", None)

    def offsets(self, text: str) -> list[tuple[int, int]]:
        """Character span ``(start, end)`` in ``text`` of each token of ``tokenize(text)``."""
        raise NotImplementedError(f"{type(self).__name__} does not provide offsets")

    def token_to_id(self, token: str) -> int | None:
        """Id of one vocabulary entry, ``None`` if it is not in the vocabulary."""
        raise NotImplementedError(f"{type(self).__name__} does not provide token_to_id")

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of one id."""
        raise NotImplementedError(f"{type(self).__name__} does not provide id_to_token")

    @property
    def backend_tokenizer(self) -> Any:
        """The underlying ``tokenizers.Tokenizer`` (character offsets, pair encoding), or ``None``."""
        return None

    def special_ids(self) -> dict[str, int | None]:
        """``{"eod": ..., "cls": ..., "sep": ..., "pad": ..., "mask": ...}``."""
        return {"eod": self.eod, "cls": self.cls, "sep": self.sep, "pad": self.pad, "mask": self.mask}

    def special_token_ids(self) -> frozenset[int]:
        """Ids of every special token (bos, eod, cls, sep, pad, mask): what generated text leaves
        out, as Hugging Face's ``decode(ids, skip_special_tokens=True)`` does."""
        ids = [self.bos, *self.special_ids().values()]
        return frozenset(i for i in ids if i is not None)

    def text_of(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without its special tokens (generated text, as users read it)."""
        skip = self.special_token_ids()
        return self.detokenize([i for i in ids if i not in skip])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, special={self.special_ids()})"


def require_file(
    path: str | os.PathLike[str] | None, flag: str, what: str, *, directory: bool = False
) -> Path:
    """``path`` as a :class:`Path` if it names an existing file (or directory); else :class:`UserError`
    naming the flag and the path."""
    if path is None or str(path) == "":
        raise UserError(f"{flag} is required ({what})")
    p = Path(path)
    if directory:
        if not p.is_dir():
            raise UserError(f"{flag} {p}: {what} directory not found")
    elif not p.is_file():
        raise UserError(f"{flag} {p}: {what} not found" + (" (it is a directory)" if p.is_dir() else ""))
    return p


class TokenizersBacked(Tokenizer):
    """A tokenizer over a Hugging Face ``tokenizers.Tokenizer`` in ``self._tok`` (GPT-2 BPE,
    WordPiece); subclasses set ``_tok``, ``_vocab_size`` and the special ids."""

    _tok: Any
    _vocab_size: int

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    @property
    def backend_tokenizer(self) -> Any:
        return getattr(self._tok, "_tokenizer", self._tok)

    def detokenize(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def offsets(self, text: str) -> list[tuple[int, int]]:
        return [tuple(o) for o in self._tok.encode(text, add_special_tokens=False).offsets]  # type: ignore[misc]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        tok = self._tok.id_to_token(int(token_id))
        if tok is None:
            raise IndexError(f"token id {token_id} is out of range for vocab size {self.vocab_size}")
        return str(tok)
