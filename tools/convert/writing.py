"""What the converting commands share: the output format (reshard, from-hf), progress bars, tokenizer files."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pretrain.checkpoint.types import TensorSource
    from pretrain.parallel.config import ParallelConfig
    from pretrain.tokenizer.loader import ResolvedTokenizer


def write_checkpoint(fmt: str, source: TensorSource, save: Path, target: ParallelConfig, **kw: Any) -> None:
    """``write_layout`` (legacy ``torch``) or :func:`write_torch_dist` with the same options."""
    from pretrain.checkpoint.legacy.writer import write_layout
    from pretrain.checkpoint.work_split import SINGLE

    optimizer_state = kw.pop("optimizer_state", None)
    distributed_optimizer = kw.pop("distributed_optimizer", False)
    if fmt == "torch":
        write_layout(source, save, target, **kw)
        return
    from pretrain.checkpoint.torch_dist.writer import write_torch_dist

    write_torch_dist(source, save, target, options=kw["options"], extra_files=kw.get("extra_files"),
                     optimizer=optimizer_state, distributed_optimizer=distributed_optimizer,
                     split=kw.get("split", SINGLE))  # fmt: skip


def progress_bar(total: int, desc: str, unit: str = "file", *, shown: bool = True) -> Any:
    """A bar on a terminal; ``disable=None`` turns it off when stderr is not a TTY (logs, CI).
    ``shown=False`` (torchrun ranks other than 0): none."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=None if shown else True, file=sys.stderr)


def tokenizer_files(tok: ResolvedTokenizer | None) -> Any:
    """``extra_files`` for :func:`write_layout`: the tokenizer's files into ``tokenizer/``."""
    from pretrain.tokenizer.loader import save_tokenizer
    from pretrain.tokenizer.record import TOKENIZER_SUBDIR

    return None if tok is None else (lambda tmp: save_tokenizer(tok.tokenizer, tmp / TOKENIZER_SUBDIR))
