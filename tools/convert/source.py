"""How a command opens its source checkpoint and which tokenizer it uses with it (the shared flags)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pretrain.tokenizer.flags import TokenizerFlags
from pretrain.utils.flag_groups import flags_from_namespace

if TYPE_CHECKING:
    from pretrain.checkpoint.types import CheckpointReader
    from pretrain.tokenizer.base import Tokenizer
    from pretrain.tokenizer.loader import ResolvedTokenizer

Given = tuple["Tokenizer", str]  # a tokenizer the flags name, and how they name it


@dataclass(frozen=True, kw_only=True)
class SourceOptions:
    """How to open the source checkpoint and which tokenizer to use with it (the shared flags:
    Megatron's ``--tokenizer-type``/``--vocab-file``/``--merge-file``/``--tokenizer-model`` or
    ``--tokenizer-dir``; none: the checkpoint's own)."""

    load: Path
    iteration: int | str | None = None
    vocab_size: int | None = None
    tok_flags: TokenizerFlags = TokenizerFlags()

    def open(self) -> tuple[CheckpointReader, Given | None]:
        """The reader, and the tokenizer the flags name when it was loaded to tell the true
        vocabulary (``args`` record none): the reader is then its :meth:`with_vocab` view."""
        from pretrain.checkpoint.opener import open_checkpoint

        reader = open_checkpoint(self.load, iteration=self.iteration, vocab_size=self.vocab_size)
        if reader.info.vocab_known or self.vocab_size is not None:
            return reader, None
        given = self.given(reader)
        if given is None:
            return reader, None
        tok, what = given
        return reader.with_vocab(tok.vocab_size, source=what), given

    def given(self, reader: CheckpointReader) -> Given | None:
        """The tokenizer the flags name and how they name it, or ``None`` (the checkpoint's own).
        Files without ``--tokenizer-type`` take the type the checkpoint names (``args`` or record)."""
        from pretrain.tokenizer.factory import build_tokenizer
        from pretrain.tokenizer.loader import load_tokenizer_dir

        flags = self.tok_flags
        cfg = flags.megatron_config(default_type=_named_tokenizer_type(reader))
        if cfg is not None:
            files = [f"{flag} {value}" for flag, value in (("--vocab-file", cfg.vocab_file),
                     ("--merge-file", cfg.merge_file), ("--tokenizer-model", cfg.model_path)) if value]  # fmt: skip
            return build_tokenizer(cfg), " ".join([f"--tokenizer-type {cfg.tokenizer_type}", *files])
        if flags.tokenizer_dir is not None:
            tok = load_tokenizer_dir(flags.tokenizer_dir, tokenizer_type=flags.tokenizer_type)
            return tok, f"--tokenizer-dir {flags.tokenizer_dir}"
        return None

    def tokenizer(
        self, reader: CheckpointReader, *, required: bool, given: Given | None = None
    ) -> ResolvedTokenizer | None:
        """The checked tokenizer (the flags' or the recorded one; see ``resolve_tokenizer``);
        ``given``: the flags' tokenizer :meth:`open` already loaded (not loaded again)."""
        from pretrain.tokenizer.loader import resolve_tokenizer

        given = given if given is not None else self.given(reader)
        return resolve_tokenizer(reader, given=given, force=self.tok_flags.force_tokenizer, required=required)


def _named_tokenizer_type(reader: CheckpointReader) -> str | None:
    """The tokenizer type a checkpoint names: its record's, else upstream ``args.tokenizer_type``."""
    meta = reader.metadata
    if meta is not None and meta.tokenizer is not None:
        return str(meta.tokenizer.tokenizer_type)
    kind = reader.args.get("tokenizer_type")
    return kind if isinstance(kind, str) else None


def source_from_args(args: argparse.Namespace) -> SourceOptions:
    return SourceOptions(load=args.load, iteration=args.iteration, vocab_size=args.vocab_size,
                         tok_flags=flags_from_namespace(TokenizerFlags, args))  # fmt: skip
