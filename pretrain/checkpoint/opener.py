"""Open any Megatron-layout checkpoint: the one entry point above the format readers.

:func:`open_checkpoint` finds the iteration directory (a checkpoint root with its tracker file,
or one iteration directory) and dispatches to the legacy ``torch`` reader
(:mod:`pretrain.checkpoint.legacy.reader`) or the ``torch_dist`` reader
(:mod:`pretrain.checkpoint.torch_dist.reader`). Both are a
:class:`~pretrain.checkpoint.types.CheckpointReader`: ``spec``, ``info``, ``metadata`` (our record
or ``None``), ``args``, ``names()``, ``tensor(name)``, ``stored_rows(name)`` and ``with_vocab(n)``
(a size learnt after opening, e.g. from the tokenizer, gives a view: nothing is read again).
:func:`load_canonical` is the one-call entry for in-memory use.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.checkpoint.expert_layout import ExpertShare
from pretrain.checkpoint.legacy.layout import TRACKER, iteration_dir, read_tracker
from pretrain.checkpoint.lora_adapter import ADAPTER_FILE
from pretrain.checkpoint.plan import ModelSpec
from pretrain.checkpoint.types import CheckpointInfo, CheckpointReader
from pretrain.checkpoint.upstream.args import VocabOptions
from pretrain.utils.errors import UserError


def find_iteration_dir(root: Path, iteration: int | str | None) -> tuple[Path, int | str | None, Path]:
    """The iteration directory, its iteration and the checkpoint root (where ``tokenizer/`` lives)."""
    if not root.is_dir():
        raise UserError(f"{root}: no such checkpoint directory")
    if (root / TRACKER).exists() or iteration is not None:
        it = read_tracker(root) if iteration is None else iteration
        path = iteration_dir(root, it)
        if not path.is_dir():
            raise UserError(f"{root}: iteration directory {path.name} does not exist")
        return path, it, root
    if any(root.glob("mp_rank_*")) or (root / "metadata.json").exists() or (root / ".metadata").exists():
        name = root.name
        it = int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else name
        return root, it, root.parent
    raise UserError(f"{root}: not a Megatron checkpoint directory (no {TRACKER}, no mp_rank_* shards)")


def open_checkpoint(
    path: str | Path,
    *,
    iteration: int | str | None = None,
    vocab_size: int | None = None,
    tokenizer_size: int | None = None,
    tokenizer_source: str = "",
    experts: ExpertShare | None = None,
) -> CheckpointReader:
    """Open a checkpoint root or one iteration directory, any format (nothing materialised).

    ``vocab_size`` (``--vocab-size``) or ``tokenizer_size`` (the size of a tokenizer the caller
    loaded, described by ``tokenizer_source``) tell the true vocabulary where ``args`` do not;
    both are checked against what the checkpoint records. ``experts``: an expert-parallel rank's
    share; legacy files of other EP ranks are then not opened and ``names()`` lists only its
    routed experts (``torch_dist`` and other sources read per tensor: callers skip the others'
    names with :meth:`ExpertShare.keeps`).
    """
    it_dir, it, root = find_iteration_dir(Path(path), iteration)
    if any(it_dir.glob(f"*/{ADAPTER_FILE}")):  # a LoRA checkpoint: its base with the adapter merged
        from pretrain.checkpoint.lora_reader import open_lora

        return open_lora(it_dir, None, open_base=open_checkpoint, vocab_size=vocab_size,
                         tokenizer_size=tokenizer_size, tokenizer_source=tokenizer_source)  # fmt: skip
    vocab = VocabOptions(
        size=vocab_size, tokenizer_size=tokenizer_size, tokenizer_source=tokenizer_source, root=str(root)
    )
    if (it_dir / "metadata.json").exists() or (it_dir / ".metadata").exists():
        from pretrain.checkpoint.torch_dist.reader import open_torch_dist

        return open_torch_dist(it_dir, it, vocab=vocab, root=root)
    from pretrain.checkpoint.legacy.reader import open_legacy

    return open_legacy(it_dir, it, vocab=vocab, root=root, experts=experts)


def load_canonical(
    path: str | Path, *, iteration: int | str | None = None, vocab_size: int | None = None,
    tokenizer_size: int | None = None, tokenizer_source: str = "",
) -> tuple[dict[str, torch.Tensor], ModelSpec, CheckpointInfo]:  # fmt: skip
    """Canonical full tensors (cloned into memory), the model spec and info of any checkpoint."""
    reader = open_checkpoint(path, iteration=iteration, vocab_size=vocab_size, tokenizer_size=tokenizer_size,
                             tokenizer_source=tokenizer_source)  # fmt: skip
    full = {name: reader.tensor(name).clone() for name in reader.names()}
    return full, reader.spec, reader.info
