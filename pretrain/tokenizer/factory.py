"""Build a :class:`Tokenizer` from Megatron's flags (``--tokenizer-type`` and its files).

=========================== ============================================ =========================
``--tokenizer-type``         files                                        special ids
=========================== ============================================ =========================
GPT2BPETokenizer            ``--vocab-file vocab.json --merge-file        eod ``<|endoftext|>``
                            merges.txt``
BertWordPieceLowerCase      ``--vocab-file vocab.txt``                    cls sep pad mask
BertWordPieceCase           ``--vocab-file vocab.txt``                    cls sep pad mask
SentencePieceTokenizer      ``--tokenizer-model x.model``                 eod cls sep pad mask
GPTSentencePieceTokenizer   ``--tokenizer-model x.model``                 eod (= eos) pad
Llama2Tokenizer             ``--tokenizer-model x.model``                 bos, eod (= eos) pad
HuggingFaceTokenizer        ``--tokenizer-model DIR`` (local directory)   eos/cls/sep/pad/mask
=========================== ============================================ =========================
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from pretrain.tokenizer.base import Tokenizer
from pretrain.utils.errors import UserError

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
)

# The files each type needs: config field -> command-line flag.
_REQUIRED: dict[str, tuple[tuple[str, str], ...]] = {
    "GPT2BPETokenizer": (("vocab_file", "--vocab-file"), ("merge_file", "--merge-file")),
    "BertWordPieceLowerCase": (("vocab_file", "--vocab-file"),),
    "BertWordPieceCase": (("vocab_file", "--vocab-file"),),
    "SentencePieceTokenizer": (("model_path", "--tokenizer-model"),),
    "GPTSentencePieceTokenizer": (("model_path", "--tokenizer-model"),),
    "Llama2Tokenizer": (("model_path", "--tokenizer-model"),),
    "HuggingFaceTokenizer": (("model_path", "--tokenizer-model"),),
}


@dataclass(frozen=True)
class TokenizerConfig:
    """Which tokenizer and its files (paths as strings, so the config pickles and hashes)."""

    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    model_path: str | None = None

    def __post_init__(self) -> None:
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise UserError(
                f"--tokenizer-type {self.tokenizer_type!r} is not supported; "
                f"choose one of {', '.join(TOKENIZER_TYPES)}"
            )
        for name in ("vocab_file", "merge_file", "model_path"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                object.__setattr__(self, name, str(value))
        for name, flag in _REQUIRED[self.tokenizer_type]:
            if not getattr(self, name):
                raise UserError(f"--tokenizer-type {self.tokenizer_type} needs {flag}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TokenizerConfig:
        """From a namespace parsed with :func:`~pretrain.tokenizer.flags.add_tokenizer_arguments` (Megatron's flag names)."""
        if not getattr(args, "tokenizer_type", None):
            raise UserError("--tokenizer-type is required")
        return cls(
            tokenizer_type=args.tokenizer_type,
            vocab_file=getattr(args, "vocab_file", None),
            merge_file=getattr(args, "merge_file", None),
            model_path=getattr(args, "tokenizer_model", None),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokenizer_type": self.tokenizer_type,
            "vocab_file": self.vocab_file,
            "merge_file": self.merge_file,
            "model_path": self.model_path,
        }


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer ``cfg`` names; :class:`UserError` (naming the file and flag) if a file is
    missing or invalid."""
    t = cfg.tokenizer_type
    if t == "GPT2BPETokenizer":
        from pretrain.tokenizer.gpt2_bpe import GPT2BPETokenizer

        return GPT2BPETokenizer(cfg.vocab_file, cfg.merge_file)  # type: ignore[arg-type]
    if t in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        from pretrain.tokenizer.wordpiece import BertWordPieceTokenizer

        return BertWordPieceTokenizer(cfg.vocab_file, lower_case=t == "BertWordPieceLowerCase")  # type: ignore[arg-type]
    if t == "SentencePieceTokenizer":
        from pretrain.tokenizer.sentencepiece_tok import SentencePieceTokenizer

        return SentencePieceTokenizer(cfg.model_path)  # type: ignore[arg-type]
    if t == "GPTSentencePieceTokenizer":
        from pretrain.tokenizer.sentencepiece_tok import GPTSentencePieceTokenizer

        return GPTSentencePieceTokenizer(cfg.model_path)  # type: ignore[arg-type]
    if t == "Llama2Tokenizer":
        from pretrain.tokenizer.sentencepiece_tok import Llama2Tokenizer

        return Llama2Tokenizer(cfg.model_path)  # type: ignore[arg-type]
    if t == "HuggingFaceTokenizer":
        from pretrain.tokenizer.hf import HuggingFaceTokenizer

        return HuggingFaceTokenizer(cfg.model_path)  # type: ignore[arg-type]
    raise UserError(f"--tokenizer-type {t!r} is not supported")  # unreachable: checked in TokenizerConfig
