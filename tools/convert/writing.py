"""What the converting commands share: the output format (reshard, from-hf), progress bars, tokenizer files."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.checkpoint.work_split import SINGLE, WorkSplit

if TYPE_CHECKING:
    from pretrain.checkpoint.types import TensorSource
    from pretrain.parallel.config import ParallelConfig
    from pretrain.tokenizer.loader import ResolvedTokenizer


def write_checkpoint(fmt: str, source: TensorSource, save: Path, target: ParallelConfig, **kw: Any) -> None:
    """``write_layout`` (legacy ``torch``) or :func:`write_torch_dist` with the same options."""
    from pretrain.checkpoint.legacy.writer import write_layout

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


@contextmanager
def fingerprint_while_writing(
    source: TensorSource,
    open_source: Callable[[], TensorSource] | None,
    extra_files: Callable[[Path], object] | None,
    *,
    ckpt_format: str,
    split: WorkSplit = SINGLE,
) -> Iterator[tuple[str, Callable[[Path], object] | None]]:
    """``(fingerprint, extra_files)`` for a writer of ``source`` in ``ckpt_format``: with the
    overlap on (:func:`~pretrain.checkpoint.deferred_fingerprint.overlap_enabled`), the placeholder and a hook that patches the value in once the background digest of
    a fresh ``open_source()`` is done (:mod:`pretrain.checkpoint.deferred_fingerprint`);
    otherwise (with no ``open_source``, or under torchrun: ``split``'s processes digest their shares
    in a collective, which a background thread must not interleave with the writers') ``source``'s
    value computed now and ``extra_files`` unchanged."""
    from pretrain.checkpoint.deferred_fingerprint import PLACEHOLDER, deferred_fingerprint, overlap_enabled
    from pretrain.checkpoint.fingerprint import weights_fingerprint

    if open_source is None or split.parallel or not overlap_enabled(ckpt_format):
        yield weights_fingerprint(source, split=split), extra_files
        return
    with deferred_fingerprint(open_source) as job:
        yield PLACEHOLDER, job.patcher(extra_files)
