"""The shared tokenizer flags: Megatron's (``--tokenizer-type`` and its files) and ``--tokenizer-dir``.

:class:`TokenizerFlags` is the flag group (its fields' ``metadata``, see
:mod:`pretrain.utils.flag_groups`); :func:`add_tokenizer_arguments` adds Megatron's four flags to the
commands that take only those (``mlm-pretrain``, ``tools/preprocess``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.tokenizer.factory import TOKENIZER_TYPES, TokenizerConfig
from pretrain.utils.errors import UserError
from pretrain.utils.flag_groups import add_flag_group, flag_meta


@dataclass(frozen=True, kw_only=True)
class TokenizerFlags:
    """Which tokenizer a command uses (Megatron's flags, or a tokenizer directory)."""

    tokenizer_type: str | None = field(
        default=None, metadata=flag_meta("which tokenizer (Megatron's names)", choices=TOKENIZER_TYPES)
    )
    vocab_file: str | None = field(
        default=None,
        metadata=flag_meta("vocab.json (GPT-2 BPE) or vocab.txt (BERT WordPiece)", metavar="PATH"),
    )
    merge_file: str | None = field(default=None, metadata=flag_meta("merges.txt (GPT-2 BPE)", metavar="PATH"))
    tokenizer_model: str | None = field(
        default=None, metadata=flag_meta("SentencePiece .model file or Hugging Face tokenizer directory")
    )
    tokenizer_dir: Path | None = field(
        default=None,
        metadata=flag_meta(
            "a tokenizer directory to use instead of the model's own (checked against the checkpoint's)",
            metavar="DIR",
        ),
    )
    force_tokenizer: bool = field(
        default=False,
        metadata=flag_meta(
            "use the given tokenizer even if it differs from the checkpoint's (the result says so)"
        ),
    )

    def megatron_config(self, *, default_type: str | None = None) -> TokenizerConfig | None:
        """The tokenizer Megatron's flags name (``--tokenizer-type`` and its files), or ``None``.

        Files given without ``--tokenizer-type`` take ``default_type`` (a checkpoint's
        ``args.tokenizer_type``: local copies of the files its training cluster named); with none,
        :class:`UserError`. ``--tokenizer-dir`` is the other way to name a tokenizer, not both."""
        files = [n for n in MEGATRON_TOKENIZER_FIELDS[1:] if getattr(self, n) is not None]
        kind = self.tokenizer_type or (default_type if files else None)
        if files and self.tokenizer_dir is not None:
            raise UserError(f"--tokenizer-dir and {_flag(files[0])} name two tokenizers; give one")
        if kind is None:
            if files:
                raise UserError(f"{_flag(files[0])} needs --tokenizer-type")
            return None
        if self.tokenizer_dir is not None:
            return None  # --tokenizer-type picks the type of the --tokenizer-dir files
        return TokenizerConfig(tokenizer_type=kind, vocab_file=self.vocab_file, merge_file=self.merge_file,
                               model_path=self.tokenizer_model)  # fmt: skip


# Megatron-LM's tokenizer flags (TokenizerFlags fields), type first
MEGATRON_TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_tokenizer_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """Add ``--tokenizer-type``, ``--vocab-file``, ``--merge-file``, ``--tokenizer-model``."""
    add_flag_group(parser, TokenizerFlags, title="tokenizer", required=("tokenizer_type",) if required else (),
                   include=("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model"))  # fmt: skip
