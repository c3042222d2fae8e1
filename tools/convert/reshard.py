"""``mlm-convert reshard``: rewrite a checkpoint at another TP/PP/VP layout (optionally with its optimizer)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from pretrain.checkpoint.work_split import SINGLE, WorkSplit
from tools.convert.writing import progress_bar, tokenizer_files, write_checkpoint

if TYPE_CHECKING:
    from pathlib import Path

    from pretrain.checkpoint.types import CheckpointReader
    from pretrain.parallel.config import ParallelConfig
    from tools.convert.source import SourceOptions


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


def run_reshard(source: SourceOptions, save: Path, target: ParallelConfig, *, with_optimizer: bool,
                ckpt_format: str = "torch", module_names: str | None = None,
                dist_optimizer: bool = False, split: WorkSplit = SINGLE) -> int:  # fmt: skip
    """``split`` (torchrun): this process's share of the target files (:mod:`~pretrain.checkpoint.work_split`)."""
    from pretrain.checkpoint.expert_layout import check_routers
    from pretrain.checkpoint.fingerprint import weights_fingerprint
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
    if prov.weights_fingerprint is None:  # resharding keeps the weights: the source's fingerprint holds
        prov = dataclasses.replace(prov, weights_fingerprint=weights_fingerprint(reader, split=split))
    options = WriteOptions(
        iteration=reader.info.iteration if reader.info.iteration is not None else "release",
        opt_param_scheduler=scheduler if isinstance(scheduler, dict) else None,
        tokenizer=None if tok is None else tok.record,
        provenance=dataclasses.replace(prov, resharded_from=str(source.load)),
        finetune=None if meta is None else meta.finetune,
        rng_state=_carried_rng(reader, target),
        module_names=module_names,
    )
    bar = progress_bar(target.tp * target.pp * target.ep, "reshard", shown=split.leader)
    with bar:
        write_checkpoint(ckpt_format, reader, save, target, options=options, optimizer=optimizer, optimizer_state=opt,
               distributed_optimizer=dist_optimizer,
               progress=lambda _name: bar.update(1), extra_files=tokenizer_files(tok), split=split)  # fmt: skip
    if not split.leader:
        return 0
    experts = f", ep={target.ep}, etp={target.expert_tp}" if target.ep > 1 or target.etp is not None else ""
    print(
        f"wrote {save} (tp={target.tp}, pp={target.pp}, vp={target.vp}{experts}, iteration {options.iteration})"
    )
    return 0
