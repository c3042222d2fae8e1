"""A reader's view with another true vocabulary size (``with_vocab``), checked as at opening.

The size a caller learns after opening (the tokenizer of ``--tokenizer-dir``, the checkpoint's own
tokenizer) goes through the same :func:`~pretrain.checkpoint.upstream.args.true_vocab_size` checks
as one given to :func:`~pretrain.checkpoint.opener.open_checkpoint`, so the view equals what a
second open would give, without reading the files again.
"""

from __future__ import annotations

import dataclasses

from pretrain.checkpoint.plan import ModelSpec
from pretrain.checkpoint.types import CheckpointInfo
from pretrain.checkpoint.upstream.args import VocabOptions, true_vocab_size
from pretrain.model_option_codecs import Args


def vocab_view(
    spec: ModelSpec, info: CheckpointInfo, args: Args, *, vocab_size: int, source: str,
    tp: int, row_numel: int,
) -> tuple[ModelSpec, CheckpointInfo]:  # fmt: skip
    """``spec`` and ``info`` for the true vocabulary ``vocab_size`` (told by ``source``).

    ``tp`` is the stored layout's TP (see ``true_vocab_size``); ``row_numel`` the elements of one
    vocabulary row summed over the vocabulary tensors (for ``info.num_parameters``).
    """
    vocab = VocabOptions(tokenizer_size=vocab_size, tokenizer_source=source, root=info.root or None)
    size, how = true_vocab_size(args, info.padded_vocab_size, tp=tp, vocab=vocab, source=info.path)
    new_spec = dataclasses.replace(spec, cfg=dataclasses.replace(spec.cfg, vocab_size=size))
    new_info = dataclasses.replace(
        info, vocab_size=size, vocab_source=how, vocab_known=not how.startswith("padded"),
        num_parameters=info.num_parameters + (size - info.vocab_size) * row_numel,
    )  # fmt: skip
    return new_spec, new_info
