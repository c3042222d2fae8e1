"""Write canonical full tensors as a checkpoint of any TP/PP/VP layout, one rank file at a time.

The source is anything with ``spec``, ``names()`` and ``tensor(name)`` (a checkpoint reader, a
Hugging Face model converted to canonical names): each target rank file is streamed
(:mod:`~pretrain.checkpoint.legacy.stream_save`): its pickle is written from the shards' dtypes and
shapes, then each shard is cut from the source's (mmap'd) full tensor when its record is written
and dropped at once, so memory stays near one full tensor plus one shard, whatever the file's size. The whole output directory is built under a
temporary sibling and renamed at the end: a failure never leaves a half-written ``--save``.
Vocabulary padding is recomputed for the target TP; the last stage gets its
``word_embeddings_for_head`` copy of the tied embeddings.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint.args import build_metadata
from pretrain.checkpoint.expert_layout import check_expert_layout, experts_per_rank, slots_of_ep_rank
from pretrain.checkpoint.legacy.layout import (
    CHECKPOINT_VERSION,
    MODEL_FILE,
    iteration_dir,
    rank_dir_name,
    write_tracker,
)
from pretrain.checkpoint.legacy.module_names import chunk_to_file
from pretrain.checkpoint.legacy.stream_save import LazyTensor, Made, stream_save_all
from pretrain.checkpoint.metadata import to_args
from pretrain.checkpoint.plan import LayoutPlan, Slot
from pretrain.checkpoint.shard_views import shard_from_pieces
from pretrain.checkpoint.tensor_meta import tensor_meta
from pretrain.checkpoint.types import (
    CheckpointMetadata,
    DictSource,
    FinetuneRecord,
    Provenance,
    RowPieces,
    TensorSource,
    TokenizerRecord,
)
from pretrain.checkpoint.work_split import SINGLE, WorkSplit
from pretrain.models.sharding import shard_tensor
from pretrain.parallel.config import ParallelConfig
from pretrain.tensor_parallel.vocab import padded_vocab_size
from pretrain.utils.atomic import atomic_open
from pretrain.utils.errors import UserError

# target shards cut from the source's stored blocks where it keeps them (pretrain.checkpoint.shard_views);
# tests switch it off to compare with the shards cut from the joined tensors
SHARDS_FROM_PIECES = True

__all__ = ["DictSource", "WriteOptions", "check_output_dir", "vocab_rows", "write_layout"]


@dataclass(frozen=True, kw_only=True)
class WriteOptions:
    """What goes into every target rank file besides the model."""

    iteration: int | str = "release"
    opt_param_scheduler: dict[str, Any] | None = None
    tokenizer: TokenizerRecord | None = None
    provenance: Provenance | None = None
    finetune: FinetuneRecord | None = None
    # rng_state entry of target rank (tp_rank, pp_rank) (e.g. carried from the source's files)
    rng_state: Callable[[int, int], list[dict[str, Any]] | None] | None = None
    module_names: str | None = None  # "mcore" / "legacy" (None: mcore for GPT, legacy for BERT)


def check_output_dir(save: Path, *, sources: tuple[Path, ...] = ()) -> None:
    """Refuse a non-empty ``--save`` and one that is (inside) a source directory."""
    save = save.resolve()
    for src in sources:
        src = src.resolve()
        if save == src or src in save.parents:
            raise UserError(f"--save {save}: must not be the source directory {src} or inside it")
    if save.exists() and (not save.is_dir() or any(save.iterdir())):
        raise UserError(f"--save {save}: exists and is not empty (choose a new directory)")


def _shard(full: torch.Tensor, slot: Slot, *, tp_rank: int, tp: int, padded: int) -> torch.Tensor:
    if slot.vocab and full.shape[0] > padded:
        raise UserError(
            f"tensor {slot.canonical}: {full.shape[0]} rows exceed the padded vocabulary {padded}"
        )
    pad = padded if slot.vocab else None
    if slot.shards is not None:  # a routed expert at ETP != TP: TP rank t holds ETP shard t % ETP
        tp_rank, tp = tp_rank % slot.shards, slot.shards
    # a view where it can be: the file writer only reads it (one copy of every tensor less)
    out = shard_tensor(
        full, dim=slot.dim, tp_rank=tp_rank, tp=tp, pad_rows_to=pad, layout=slot.layout, copy=False
    )
    if tuple(out.shape) != slot.shape:
        raise UserError(
            f"tensor {slot.canonical}: target shard shape {tuple(out.shape)} != expected {slot.shape} "
            f"(source full shape {tuple(full.shape)})"
        )
    # a row-parallel shard stays a strided view: the file writer gathers its rows
    return out


def _block_pieces(full: torch.Tensor, slot: Slot, *, tp_rank: int, tp: int) -> RowPieces | None:
    """A SwiGLU shard (the rank's rows of each of ``[gate; up]``) as the two row blocks of ``full``,
    which the file writer gathers into the record (:func:`_shard` joins them); None elsewhere."""
    lay = slot.layout
    if lay is None or lay.blocks < 2 or slot.dim != 0 or slot.vocab or slot.shards is not None or tp < 2:
        return None
    pieces = RowPieces(tuple(b.chunk(tp, dim=0)[tp_rank] for b in full.chunk(lay.blocks, dim=0)))
    return (
        pieces if tuple(pieces.shape) == slot.shape and all(p.is_contiguous() for p in pieces.parts) else None
    )


def vocab_rows(source: TensorSource, name: str, padded: int) -> torch.Tensor:
    """Vocabulary tensor ``name`` for a target padded to ``padded`` rows: the true vocabulary,
    then as many of the padding rows the source stores as fit (the shard writer zero-fills the
    rest). megatron-core's softmax spans the padded vocabulary, so its runs train the padding
    rows of the output layer (and, tied, of the embedding); carrying them keeps a resumed Megatron
    run exact whenever the padded size is kept. Our models never read them (padded logits are
    excluded); sources without stored rows (Hugging Face) give the true vocabulary only."""
    return source.stored_rows(name)[:padded]


class _LastTensor:
    """The source's full tensors for the target's shards, the last one kept: a stage's TP ranks,
    written in lockstep, cut their shards of one tensor from one read."""

    def __init__(self, source: TensorSource, padded: int) -> None:
        self.source, self.padded = source, padded
        self.key: tuple[str, bool] | None = None
        self.full: torch.Tensor | None = None

    def get(self, slot: Slot) -> torch.Tensor:
        key = (slot.canonical, slot.vocab)
        if key != self.key or self.full is None:
            self.full = None  # the previous one goes before the next is read
            name = slot.canonical
            self.full = vocab_rows(self.source, name, self.padded) if slot.vocab else self.source.tensor(name)
            self.key = key
        return self.full

    def clear(self) -> None:
        self.key, self.full = None, None


def _chunk_state(
    last: _LastTensor, slots: list[Slot], *, tp_rank: int, tp: int, padded: int
) -> dict[str, LazyTensor]:
    """The chunk's tensors as placeholders: each shard is cut from its full tensor only when the
    file writer reaches it (:mod:`~pretrain.checkpoint.legacy.stream_save`)."""

    def maker(slot: Slot) -> Callable[[], Made]:
        def make() -> Made:
            view = (
                shard_from_pieces(last.source, slot, tp_rank=tp_rank, tp=tp) if SHARDS_FROM_PIECES else None
            )
            if view is not None:
                return view
            full = last.get(slot)
            blocks = _block_pieces(full, slot, tp_rank=tp_rank, tp=tp)
            return blocks if blocks is not None else _shard(full, slot, tp_rank=tp_rank, tp=tp, padded=padded)

        return make

    return {
        slot.local: LazyTensor(tensor_meta(last.source, slot.canonical).dtype, tuple(slot.shape), maker(slot))
        for slot in slots
    }


def _target_metadata(
    source: TensorSource, target: ParallelConfig, options: WriteOptions
) -> CheckpointMetadata:
    spec = source.spec
    tok = options.tokenizer
    if tok is not None and tok.vocab_size > spec.cfg.vocab_size:
        raise UserError(
            f"the tokenizer ({tok.tokenizer_type}) has {tok.vocab_size} tokens but the model only "
            f"{spec.cfg.vocab_size} vocabulary rows"
        )
    meta = build_metadata(
        spec.cfg, target, kind=spec.kind, tokenizer=tok, provenance=options.provenance,
        add_binary_head=spec.add_binary_head, fresh_heads=spec.fresh_heads, finetune=options.finetune,
        module_names=options.module_names,
    )  # fmt: skip
    return meta


def _rank_file(
    chunks: dict[str, Any], *, args: Any, options: WriteOptions, optimizer: dict[str, Any] | None,
    ranks: tuple[int, int],
) -> dict[str, Any]:  # fmt: skip
    """One rank file's state: the model chunks, args, optimizer, scheduler and (TP, PP) rank's RNG."""
    out: dict[str, Any] = {
        "iteration": options.iteration,
        "checkpoint_version": CHECKPOINT_VERSION,
        "args": args,
    }
    out.update(chunks)
    out["optimizer"] = optimizer
    out["opt_param_scheduler"] = options.opt_param_scheduler
    rng = options.rng_state(*ranks) if options.rng_state else None
    if rng is not None:
        out["rng_state"] = rng
    return out


def _write_rank_files(
    it_dir: Path, target: ParallelConfig, pp_rank: int, ep: int | None, state: Callable[[int], dict[str, Any]],
    *, tp_ranks: list[int], lockstep: bool, progress: Callable[[str], None] | None, done: Callable[[], None],
) -> None:  # fmt: skip
    """The TP rank files ``tp_ranks`` of one (stage, EP rank): in lockstep (each full tensor read
    once for all of them), or with an optimizer one rank at a time (its states are real tensors)."""
    groups = [tp_ranks] if lockstep else [[t] for t in tp_ranks]
    for ranks in groups:
        names = [rank_dir_name(t, pp_rank, target.pp, ep) for t in ranks]
        with contextlib.ExitStack() as stack:
            fhs = [stack.enter_context(atomic_open(it_dir / n / MODEL_FILE, "w+b")) for n in names]
            stream_save_all([(state(t), fh) for t, fh in zip(ranks, fhs, strict=True)])
        done()  # drop the last full tensor kept for these ranks
        for name in names:
            if progress is not None:
                progress(name)


def write_layout(
    source: TensorSource,
    save: str | Path,
    target: ParallelConfig,
    *,
    options: WriteOptions = WriteOptions(),
    optimizer: Callable[[int, int, list[list[Slot]]], dict[str, Any] | None] | None = None,
    progress: Callable[[str], None] | None = None,
    extra_files: Callable[[Path], object] | None = None,
    split: WorkSplit = SINGLE,
) -> Path:
    """Write ``source`` at layout ``target`` into the new directory ``save``; returns ``save``.

    With ``target.ep > 1`` each (TP, PP) rank has one file per EP rank (``mp_rank_TT[_PPP]_EEE``)
    holding its own experts under local indices (:mod:`pretrain.checkpoint.expert_layout`).

    ``optimizer(tp_rank, pp_rank, slots_per_chunk)`` may supply each rank file's ``optimizer``
    entry. ``progress`` is called with each rank directory name after it is written;
    ``extra_files(tmp_dir)`` may add files (e.g. the tokenizer) before the directory is renamed.

    ``split``: under torchrun each process writes its own rank files (:func:`_file_owners`) into
    one temporary directory, and rank 0 the tracker and ``extra_files`` once all are written.
    """
    plan = LayoutPlan.for_parallel(source.spec, target)
    cfg = source.spec.cfg
    check_expert_layout(cfg, target, legacy=True)
    per_rank = experts_per_rank(cfg, target.ep)
    padded = padded_vocab_size(cfg.vocab_size, tp=target.tp, divisible_by=cfg.make_vocab_size_divisible_by)
    meta = _target_metadata(source, target, options)
    args = to_args(meta, iteration=options.iteration)
    save = Path(save)
    stages = [[plan.slots(pp_rank, c) for c in range(target.vp)] for pp_rank in range(target.pp)]
    owners = iter(_file_owners(source, stages, target, split))
    with split.directory(save) as tmp:
        it_dir = iteration_dir(tmp, options.iteration)
        last = _LastTensor(source, padded)
        for pp_rank, stage in enumerate(stages):
            for ep_rank in range(target.ep):  # the expert-free layout's files when EP == 1
                mine = [t for t in range(target.tp) if next(owners) == split.rank]
                if not mine:
                    continue
                slots = [slots_of_ep_rank(x, ep_rank=ep_rank, per_rank=per_rank) for x in stage]

                def state(
                    tp_rank: int, pp_rank: int = pp_rank, slots: list[list[Slot]] = slots
                ) -> dict[str, Any]:
                    chunks = {
                        key: chunk_to_file(
                            _chunk_state(last, chunk_slots, tp_rank=tp_rank, tp=target.tp, padded=padded),
                            names=meta.module_names, kind=meta.kind,
                        )
                        for key, chunk_slots in zip(plan.chunk_keys(), slots, strict=True)
                    }  # fmt: skip
                    opt = optimizer(tp_rank, pp_rank, slots) if optimizer else None
                    return _rank_file(
                        chunks, args=args, options=options, optimizer=opt, ranks=(tp_rank, pp_rank)
                    )

                ep = ep_rank if target.ep > 1 else None
                _write_rank_files(it_dir, target, pp_rank, ep, state, tp_ranks=mine, lockstep=optimizer is None,
                                  progress=progress, done=last.clear)  # fmt: skip
        split.agree()  # every rank file is written
        if split.leader:
            write_tracker(tmp, options.iteration)
            if extra_files is not None:
                extra_files(tmp)
    return save


def _file_owners(
    source: TensorSource, stages: list[list[list[Slot]]], target: ParallelConfig, split: WorkSplit
) -> list[int]:
    """The rank writing each target rank file, in writing order (stage, EP rank, TP rank), balanced
    by the model bytes of the files: whole stages where they are many, TP ranks of one otherwise."""
    if not split.parallel:
        return [0] * (len(stages) * target.ep * target.tp)
    per_rank = experts_per_rank(source.spec.cfg, target.ep)
    sizes = []
    for stage in stages:
        for ep_rank in range(target.ep):
            slots = [
                s for chunk in stage for s in slots_of_ep_rank(chunk, ep_rank=ep_rank, per_rank=per_rank)
            ]
            nbytes = sum(math.prod(s.shape) * tensor_meta(source, s.canonical).dtype.itemsize for s in slots)
            sizes += [nbytes] * target.tp
    return split.owners(sizes)
