"""``mlm-convert reshard``: rewrite a checkpoint at another TP/PP/VP layout (optionally with its optimizer)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from pretrain.checkpoint.work_split import SINGLE, WorkSplit
from tools.convert.writing import fingerprint_while_writing, progress_bar, tokenizer_files, write_checkpoint

if TYPE_CHECKING:
    from pathlib import Path

    from pretrain.checkpoint.legacy.writer import WriteOptions
    from pretrain.checkpoint.types import CheckpointReader
    from pretrain.parallel.config import ParallelConfig
    from tools.convert.source import Given, SourceOptions


def _carried_rng(reader: CheckpointReader, target: ParallelConfig) -> Any:
    """Each target rank's ``rng_state``: the source rank file's at the same (tp, pp) modulo the
    source layout (the tracker states of TP rank t stay with TP rank t)."""
    states, info = getattr(reader, "states", None), reader.info
    if not states:
        return None

    def rng(tp_rank: int, pp_rank: int) -> Any:
        state = states[(pp_rank % info.pp) * info.tp + tp_rank % info.tp]
        return state.get("rng_state")

    return rng


@contextlib.contextmanager
def _fingerprint(reader: CheckpointReader, source: SourceOptions, given: Given | None, options: WriteOptions,
                 extra: Callable[[Path], object] | None, *, ckpt_format: str, split: WorkSplit) -> Iterator[tuple[WriteOptions, Callable[[Path], object] | None]]:  # fmt: skip
    """The options with the weights fingerprint (resharding keeps the weights: a recorded one
    holds; else computed from a second reader of the source while the output is written) and the
    ``extra_files`` hook that patches it in (:func:`fingerprint_while_writing`). Under torchrun
    (``split``) the processes digest their shares first, as before (a collective)."""
    prov = options.provenance
    if prov is None or prov.weights_fingerprint is not None:
        yield options, extra
        return

    from pretrain.checkpoint.legacy.reader import LegacyReader
    from pretrain.checkpoint.opener import open_checkpoint

    def reopen() -> CheckpointReader:
        if isinstance(reader, LegacyReader):
            # a second view of the same mapped rank files (tensor() only reads them): the
            # checkpoint is still opened once per command (tests/test_opens_once.py)
            return dataclasses.replace(reader)
        again = open_checkpoint(source.load, iteration=source.iteration, vocab_size=source.vocab_size)
        return again if given is None else again.with_vocab(given[0].vocab_size, source=given[1])

    with fingerprint_while_writing(reader, reopen, extra, ckpt_format=ckpt_format, split=split) as (
        value,
        hook,
    ):
        yield (
            dataclasses.replace(options, provenance=dataclasses.replace(prov, weights_fingerprint=value)),
            hook,
        )


def run_reshard(source: SourceOptions, save: Path, target: ParallelConfig, *, with_optimizer: bool,
                ckpt_format: str = "torch", module_names: str | None = None,
                dist_optimizer: bool = False, split: WorkSplit = SINGLE) -> int:  # fmt: skip
    """``split`` (torchrun): this process's share of the target files (:mod:`~pretrain.checkpoint.work_split`)."""
    from pretrain.checkpoint.expert_layout import check_routers
    from pretrain.checkpoint.legacy.writer import WriteOptions, check_output_dir
    from pretrain.checkpoint.types import Provenance

    check_output_dir(save, sources=(source.load,))
    reader, given = source.open()
    check_routers(reader, where=str(source.load))  # a lost router is refused before writing
    tok = source.tokenizer(reader, required=False, given=given)
    opt = None
    if with_optimizer:
        from pretrain.checkpoint.optimizer.reshard import open_optimizer_source

        opt = open_optimizer_source(reader)
    optimizer = None
    if opt is not None and ckpt_format == "torch":
        from pretrain.checkpoint.optimizer.reshard import optimizer_writer

        optimizer = optimizer_writer(opt, reader.spec, target)
    scheduler = (
        opt.scheduler if opt is not None else getattr(reader, "states", [{}])[0].get("opt_param_scheduler")
    )
    meta = reader.metadata
    prov = meta.provenance if meta is not None else Provenance(iteration=reader.info.iteration)
    if prov.global_batch_size is None and opt is not None and opt.global_batch_size:
        prov = dataclasses.replace(prov, global_batch_size=opt.global_batch_size)  # the schedule's unit
    options = WriteOptions(
        iteration=reader.info.iteration if reader.info.iteration is not None else "release",
        opt_param_scheduler=scheduler if isinstance(scheduler, dict) else None,
        tokenizer=None if tok is None else tok.record,
        provenance=dataclasses.replace(prov, resharded_from=str(source.load)),
        finetune=None if meta is None else meta.finetune,
        rng_state=_carried_rng(reader, target),
        module_names=module_names,
    )
    extra = tokenizer_files(tok)
    bar = progress_bar(target.tp * target.pp * target.ep, "reshard", shown=split.leader)
    with (
        bar,
        _fingerprint(reader, source, given, options, extra, ckpt_format=ckpt_format, split=split) as (
            options,
            extra,
        ),
    ):
        write_checkpoint(ckpt_format, reader, save, target, options=options, optimizer=optimizer, optimizer_state=opt,
               distributed_optimizer=dist_optimizer,
               progress=lambda _name: bar.update(1), extra_files=extra, split=split)  # fmt: skip
    if not split.leader:
        return 0
    experts = f", ep={target.ep}, etp={target.expert_tp}" if target.ep > 1 or target.etp is not None else ""
    print(
        f"wrote {save} (tp={target.tp}, pp={target.pp}, vp={target.vp}{experts}, iteration {options.iteration})"
    )
    return 0
