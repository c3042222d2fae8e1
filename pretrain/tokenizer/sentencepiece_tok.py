"""SentencePiece models (``--tokenizer-model file.model``).

Two flavours, with Megatron's ids:

* ``SentencePieceTokenizer`` (BERT/T5 style): the special tokens ``<CLS>``, ``<SEP>``, ``<EOD>``,
  ``<MASK>`` (and ``<PAD>``/``<BOS>``/``<EOS>`` when the model has no pad/bos/eos piece) are
  appended after the model's pieces if the model lacks them, so ``vocab_size`` may exceed the
  model's piece count; their literal text in the input is tokenized as that special id.
* ``GPTSentencePieceTokenizer``: the model's pieces only; ``eod`` is the model's ``</s>`` (eos).
* ``Llama2Tokenizer``: as ``GPTSentencePieceTokenizer`` plus ``bos`` (``<s>``), which Llama's
  convention puts before every document (``adds_bos``; Megatron's ``tokenize(bos=True)``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from pretrain.tokenizer.base import Tokenizer, require_file
from pretrain.utils.errors import UserError


def _load_processor(model_file: str | os.PathLike[str], flag: str):  # type: ignore[no-untyped-def]
    import sentencepiece

    path = require_file(model_file, flag, "SentencePiece model")
    try:
        proc = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except Exception as exc:  # RuntimeError / OSError from the C++ library
        raise UserError(f"{flag} {path}: not a SentencePiece model ({exc})") from None
    return path, proc


class GPTSentencePieceTokenizer(Tokenizer):
    tokenizer_type = "GPTSentencePieceTokenizer"

    def __init__(self, model_file: str | os.PathLike[str], *, model_flag: str = "--tokenizer-model") -> None:
        path, self._sp = _load_processor(model_file, model_flag)
        self.model_file = str(path)

    def tokenize(self, text: str) -> list[int]:
        return list(self._sp.encode_as_ids(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        return str(self._sp.decode_ids([int(i) for i in ids]))

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @staticmethod
    def _valid(i: int) -> int | None:
        return int(i) if i >= 0 else None

    @property
    def eod(self) -> int | None:
        return self._valid(self._sp.eos_id())

    @property
    def pad(self) -> int | None:
        return self._valid(self._sp.pad_id())

    def token_to_id(self, token: str) -> int | None:
        i = int(self._sp.piece_to_id(token))
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i

    def id_to_token(self, token_id: int) -> str:
        if not 0 <= int(token_id) < self.vocab_size:
            raise IndexError(f"token id {token_id} is out of range for vocab size {self.vocab_size}")
        return str(self._sp.id_to_piece(int(token_id)))


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    tokenizer_type = "Llama2Tokenizer"
    adds_bos = True

    @property
    def bos(self) -> int | None:
        return self._valid(self._sp.bos_id())


class SentencePieceTokenizer(Tokenizer):
    tokenizer_type = "SentencePieceTokenizer"

    def __init__(self, model_file: str | os.PathLike[str], *, model_flag: str = "--tokenizer-model") -> None:
        path, self._sp = _load_processor(model_file, model_flag)
        self.model_file = str(path)
        self._vocab: dict[str, int] = {}
        self._inv_vocab: dict[int, str] = {}
        for i in range(self._sp.get_piece_size()):
            piece = self._sp.id_to_piece(i)
            self._vocab[piece] = i
            self._inv_vocab[i] = piece
        self._special: dict[str, int] = {}

        def add(token: str) -> int:
            if token not in self._vocab:
                new_id = len(self._vocab)
                self._vocab[token] = new_id
                self._inv_vocab[new_id] = token
            self._special[token] = self._vocab[token]
            return self._vocab[token]

        def model_piece(i: int, fallback: str) -> str:
            return str(self._sp.id_to_piece(i)) if 0 <= i < self._sp.get_piece_size() else fallback

        self._cls = add("<CLS>")
        self._sep = add("<SEP>")
        self._eod = add("<EOD>")
        self._mask = add("<MASK>")
        self._pad = add(model_piece(self._sp.pad_id(), "<PAD>"))
        self._bos = add(model_piece(self._sp.bos_id(), "<BOS>"))
        self.eos = add(model_piece(self._sp.eos_id(), "<EOS>"))
        # Longest first so that a special token never matches as the prefix of a longer one.
        self._special_re = re.compile(
            "|".join(re.escape(t) for t in sorted(self._special, key=len, reverse=True))
        )

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                ids.extend(self._sp.encode_as_ids(text[pos : m.start()]))
            ids.append(self._special[m.group(0)])
            pos = m.end()
        if pos < len(text):
            ids.extend(self._sp.encode_as_ids(text[pos:]))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        inv_special = {v: k for k, v in self._special.items()}
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            i = int(i)
            if i in inv_special:
                parts.append(self._sp.decode_ids(run) + " " + inv_special[i] + " ")
                run = []
            else:
                run.append(i)
        parts.append(self._sp.decode_ids(run))
        return "".join(parts)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def token_to_id(self, token: str) -> int | None:
        return self._vocab.get(token)

    def id_to_token(self, token_id: int) -> str:
        try:
            return self._inv_vocab[int(token_id)]
        except KeyError:
            raise IndexError(
                f"token id {token_id} is out of range for vocab size {self.vocab_size}"
            ) from None
