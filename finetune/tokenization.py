"""Sentence-pair inputs ``[CLS] A [SEP] B [SEP]`` over a Hugging Face fast (WordPiece) tokenizer.

Token types are 0 for ``[CLS]``, segment A and the first ``[SEP]``; 1 for segment B and the last
``[SEP]`` (Megatron ``tasks/data_utils.py``). Two truncation rules are offered:

* ``"pair"`` (default, used for GLUE): BERT's ``truncate_seq_pair`` -- pop one token at a time from
  the end of the longer segment until ``[CLS] A [SEP] B [SEP]`` fits.
* ``"cap"`` (used for RACE, as upstream ``build_tokens_types_paddings_from_ids``): keep A whole and
  cut B at the end. Upstream caps the concatenation; that is the same thing whenever A fits, which
  RACE guarantees by first cutting the question+option to ``max_qa_length`` tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tokenizers import Tokenizer

from pretrain.utils.errors import UserError

Truncation = Literal["pair", "cap"]
Offset = tuple[int, int]


def clean_text(text: str) -> str:
    """Megatron's ``clean_text``: newlines to spaces, collapse whitespace, tighten `` . ``."""
    text = text.replace("\n", " ")
    text = re.sub(r"\s+", " ", text)
    for _ in range(3):
        text = text.replace(" . ", ". ")
    return text


def truncate_seq_pair(tokens_a: list[Any], tokens_b: list[Any], max_num_tokens: int) -> None:
    """Truncate two lists in place, one token at a time from the longer one (ties: from B)."""
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        longer.pop()


@dataclass(frozen=True, kw_only=True)
class PairEncoding:
    """One padded model input; all lists have length ``max_seq_length``."""

    input_ids: list[int]
    token_type_ids: list[int]
    attention_mask: list[int]
    # Number of tokens of A and B kept after truncation (callers map token positions back with them).
    len_a: int
    len_b: int

    @property
    def b_start(self) -> int:
        """Index of the first token of segment B (``[CLS] A [SEP]`` precede it)."""
        return self.len_a + 2


def _backend_of(tokenizer: Any) -> Tokenizer:
    """A private copy of the Rust tokenizer with truncation and padding switched off.

    A copy, because the HF wrapper toggles truncation/padding on its backend per call and a
    left-over setting would silently cut long SQuAD contexts.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not isinstance(backend, Tokenizer):
        raise UserError(
            f"tokenizer {type(tokenizer).__name__} is not a Hugging Face fast tokenizer "
            "(need a tokenizers.Tokenizer or a PreTrainedTokenizerFast for character offsets)"
        )
    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


def _special_id(tokenizer: Any, backend: Tokenizer, attr: str, token: str) -> int:
    value = getattr(tokenizer, attr, None)  # transformers' name
    if not isinstance(value, int):  # our pretrain.tokenizer.Tokenizer: cls / sep / pad
        value = getattr(tokenizer, attr.removesuffix("_token_id"), None)
    if isinstance(value, int):
        return value
    found = backend.token_to_id(token)
    if found is None:
        raise UserError(f"tokenizer vocabulary has no {token} token (needed for [CLS] A [SEP] B [SEP])")
    return found


class PairEncoder:
    """Builds padded ``[CLS] A [SEP] B [SEP]`` inputs from text or token ids.

    ``tokenizer`` is one of our :class:`pretrain.tokenizer.Tokenizer` objects (the same ones
    pretraining uses), a ``transformers.PreTrainedTokenizerFast`` or a ``tokenizers.Tokenizer``.
    """

    def __init__(self, tokenizer: Any, max_seq_length: int) -> None:
        if max_seq_length < 3:
            raise UserError(f"--seq-length must be at least 3 for [CLS] A [SEP], got {max_seq_length}")
        self.max_seq_length = max_seq_length
        self._backend = _backend_of(tokenizer)
        self.cls_id = _special_id(tokenizer, self._backend, "cls_token_id", "[CLS]")
        self.sep_id = _special_id(tokenizer, self._backend, "sep_token_id", "[SEP]")
        self.pad_id = _special_id(tokenizer, self._backend, "pad_token_id", "[PAD]")

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def tokenize_with_offsets(self, text: str) -> tuple[list[int], list[Offset]]:
        """Token ids and ``(start, end)`` character offsets into ``text`` of each token."""
        enc = self._backend.encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]  # type: ignore[misc]

    def encode(
        self, text_a: str, text_b: str | None = None, *, truncation: Truncation = "pair"
    ) -> PairEncoding:
        """Tokenize and build one padded input (see :meth:`encode_ids`)."""
        ids_b = None if text_b is None else self.tokenize(text_b)
        return self.encode_ids(self.tokenize(text_a), ids_b, truncation=truncation)

    def encode_ids(
        self, ids_a: Sequence[int], ids_b: Sequence[int] | None = None, *, truncation: Truncation = "pair"
    ) -> PairEncoding:
        """Build ``[CLS] A [SEP] (B [SEP])`` from token ids, truncated and padded to max_seq_length."""
        a, b = list(ids_a), (None if ids_b is None else list(ids_b))
        budget = self.max_seq_length - (2 if b is None else 3)
        if b is None:
            del a[budget:]
        elif truncation == "pair":
            truncate_seq_pair(a, b, budget)
        elif truncation == "cap":
            del a[budget:]
            del b[budget - len(a) :]
        else:
            raise UserError(f"unknown truncation {truncation!r}; expected 'pair' or 'cap'")
        ids = [self.cls_id, *a, self.sep_id]
        types = [0] * len(ids)
        if b is not None:
            ids += [*b, self.sep_id]
            types += [1] * (len(b) + 1)
        pad = self.max_seq_length - len(ids)
        return PairEncoding(
            input_ids=ids + [self.pad_id] * pad,
            token_type_ids=types + [0] * pad,
            attention_mask=[1] * len(ids) + [0] * pad,
            len_a=len(a),
            len_b=0 if b is None else len(b),
        )
