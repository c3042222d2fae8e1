"""Any Hugging Face tokenizer directory (``--tokenizer-model DIR``), loaded with ``AutoTokenizer``.

Local files only: nothing is downloaded (a hub name that is not a local directory is an error).
``tokenize`` adds no special tokens (no BOS); ``eod`` is the tokenizer's eos token, ``vocab_size``
is ``len(tokenizer)`` (base vocabulary plus added tokens), as in Megatron's ``HuggingFaceTokenizer``.
Unlike :class:`~pretrain.tokenizer.gpt2_bpe.GPT2BPETokenizer`, the literal text of a special token
(``<|endoftext|>``) in the input is tokenized as that token's id (the library's behaviour).
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pretrain.tokenizer.base import Tokenizer, require_file
from pretrain.utils.errors import UserError


def hf_adds_bos(tok: Any) -> bool:
    """Whether a ``transformers`` tokenizer's own encoding (special tokens on) starts with its BOS
    token, as Llama's do and GPT-2's do not (whatever adds it: ``add_bos_token`` or a template)."""
    bos = tok.bos_token_id
    if not isinstance(bos, int):
        return False
    with_special = list(tok("a", add_special_tokens=True)["input_ids"])
    return with_special[:1] == [bos] and list(tok("a", add_special_tokens=False)["input_ids"])[:1] != [bos]


class HuggingFaceTokenizer(Tokenizer):
    tokenizer_type = "HuggingFaceTokenizer"

    def __init__(self, path: str | os.PathLike[str], *, model_flag: str = "--tokenizer-model") -> None:
        directory = require_file(path, model_flag, "Hugging Face tokenizer", directory=True)
        try:
            from transformers import AutoTokenizer

            self._tok: Any = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as exc:  # OSError, ValueError, ... from transformers
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"{model_flag} {directory}: cannot load a Hugging Face tokenizer ({first})"
            ) from None
        self.model_path = str(directory)
        self._vocab_size = len(self._tok)
        self.adds_bos = hf_adds_bos(self._tok)

    def save_pretrained(self, directory: str | os.PathLike[str]) -> list[str]:
        """Write the tokenizer ``AutoTokenizer`` resolved (its class named in ``tokenizer_config.json``,
        its pre-tokenizer and special tokens in ``tokenizer.json``) into ``directory``: the file
        names written. Copying the source's files instead can lose what the class adds (Qwen2's
        digit splitting and pad token come from ``config.json``'s ``model_type``, not copied)."""
        written = self._tok.save_pretrained(str(directory))
        return sorted({Path(f).name for f in written if Path(f).is_file()})

    @functools.cached_property
    def saved_names(self) -> tuple[str, ...]:
        """The file names :meth:`save_pretrained` writes (for the checkpoint's record)."""
        with tempfile.TemporaryDirectory() as tmp:
            return tuple(self.save_pretrained(tmp))

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def detokenize(self, ids: Sequence[int]) -> str:
        return str(
            self._tok.decode(
                [int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

    def special_token_ids(self) -> frozenset[int]:
        return frozenset(int(i) for i in self._tok.all_special_ids)

    def offsets(self, text: str) -> list[tuple[int, int]]:
        if not getattr(self._tok, "is_fast", False):
            raise NotImplementedError("offsets need a fast (Rust) Hugging Face tokenizer")
        enc = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return [(int(a), int(b)) for a, b in enc["offset_mapping"]]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def hf_tokenizer(self) -> Any:
        """The ``transformers`` tokenizer itself (its chat template, ``apply_chat_template``)."""
        return self._tok

    @property
    def backend_tokenizer(self) -> Any:
        return getattr(self._tok, "backend_tokenizer", None)

    @property
    def bos(self) -> int | None:
        return self._id(self._tok.bos_token_id)

    @staticmethod
    def _id(value: Any) -> int | None:
        return int(value) if isinstance(value, int) else None

    @property
    def eod(self) -> int | None:
        return self._id(self._tok.eos_token_id)

    @property
    def cls(self) -> int | None:
        return self._id(self._tok.cls_token_id)

    @property
    def sep(self) -> int | None:
        return self._id(self._tok.sep_token_id)

    @property
    def pad(self) -> int | None:
        return self._id(self._tok.pad_token_id)

    @property
    def mask(self) -> int | None:
        return self._id(self._tok.mask_token_id)

    def token_to_id(self, token: str) -> int | None:
        vocab = self._tok.get_vocab()
        return int(vocab[token]) if token in vocab else None

    def id_to_token(self, token_id: int) -> str:
        tok = self._tok.convert_ids_to_tokens(int(token_id))
        if tok is None:
            raise IndexError(f"token id {token_id} is out of range for vocab size {self.vocab_size}")
        return str(tok)
