"""Write canonical full tensors as a megatron-core ``torch_dist`` checkpoint, streaming.

The output is what ``megatron.core.dist_checkpointing.save`` writes for a ``GPTModel`` or a
``BertModel`` (local spec; layers under ``decoder`` / ``encoder``), so
megatron-core's ``dist_checkpointing.load`` (and Megatron-LM ``--ckpt-format torch_dist``) accept
it at any TP/PP: ``ROOT/latest_checkpointed_iteration.txt`` and ``ROOT/iter_N/`` with

* ``.metadata`` + ``__0_0.distcp`` (and ``__0_1.distcp`` on two cores or more, as megatron-core
  writes two files per rank): a PyTorch distributed checkpoint keyed by megatron-core's
  sharded-state-dict keys (:func:`~pretrain.checkpoint.upstream.names.to_mcore_key`): global
  shapes, layers stacked along a leading axis ``[num_layers, ...]`` and stored one chunk per layer
  (the chunks megatron-core itself writes along that axis); the word embeddings (and an untied
  ``output_layer``, and BERT's MLM output bias ``output_layer.bias``) padded for the target TP; the ``_extra_state`` byte entries of every linear
  layer (``<key>/shard_<layer>_<num_layers>``, holding ``[None]`` as the local spec saves them);
* ``common.pt``: ``args`` (Megatron-LM's Namespace with our record, see
  :mod:`pretrain.checkpoint.metadata`), ``iteration``, ``checkpoint_version``;
* ``metadata.json``: the backend names megatron-core checks.

The save plan (dcp's: one item per stored chunk, then the byte entries) is ours, and so are the
writers: the file writer (:mod:`~pretrain.checkpoint.torch_dist.distcp_writer`) asks the source
for each layer's tensor only when it reaches it and drops each chunk once written, so memory stays
near one tensor, and fills the archives' CRC-32s by ISA-L, not by torch's slow loop; the
``.metadata`` is pickled as dcp's classes (:mod:`~pretrain.checkpoint.torch_dist.dcp_meta_write`).
Neither imports ``torch.distributed.checkpoint`` (a second of a 1B conversion), and the bytes are
those ``dcp.save`` with ``FileSystemWriter`` writes (``tests/test_dcp_meta_write.py``). The
directory is built under a temporary sibling and renamed at the end (nothing half-written).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint.expert_layout import check_expert_layout
from pretrain.checkpoint.legacy.layout import CHECKPOINT_VERSION, iteration_dir, write_tracker
from pretrain.checkpoint.legacy.stream_save import LazyTensor
from pretrain.checkpoint.legacy.writer import WriteOptions, _target_metadata, vocab_rows
from pretrain.checkpoint.metadata import to_args
from pretrain.checkpoint.optimizer.state import MCORE_STATE_PREFIX, OptimizerSource
from pretrain.checkpoint.plan import ModelSpec, chunk_slots
from pretrain.checkpoint.torch_dist.dcp_failures import first_line
from pretrain.checkpoint.torch_dist.dcp_meta_write import (
    StoredChunk,
    build_metadata,
    new_save_id,
    write_dcp_metadata,
)
from pretrain.checkpoint.torch_dist.distcp_writer import write_distcp_files
from pretrain.checkpoint.torch_dist.optimizer import optimizer_common, optimizer_entry_kinds
from pretrain.checkpoint.types import ColumnPieces, ColumnPieceSource, RowPieces, RowPieceSource, TensorSource
from pretrain.checkpoint.upstream.expert_names import to_dist_expert
from pretrain.checkpoint.upstream.names import MCORE_BLOCK, to_mcore_key
from pretrain.checkpoint.work_split import SINGLE, WorkSplit
from pretrain.config import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.tensor_parallel.vocab import padded_vocab_size
from pretrain.utils.atomic import atomic_open
from pretrain.utils.errors import UserError

# chunks written from the source's stored blocks where it keeps them (_ChunkMaker.pieces);
# tests switch it off to compare with the chunks joined first
CHUNKS_FROM_PIECES = True

METADATA_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
_LINEAR_WEIGHT = re.compile(r"\.(linear_qkv|linear_proj|linear_fc1|linear_fc2)\.weight$")
_LAYER = re.compile(r"^language_model\.encoder\.layers\.(\d+)\.(.*)$")


@dataclass(frozen=True)
class _Entry:
    """One stored tensor key: its global shape and, per chunk, the canonical tensor it comes from."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # (canonical name, index along the leading axes: (layer,), (layer, expert), (expert,) or () whole)
    parts: tuple[tuple[str, tuple[int, ...]], ...]
    pad_rows: int | None  # vocabulary tensors: padded row count
    state_kind: str | None = None  # an optimizer state ("exp_avg", ...) of the weight; None: the weight
    lead: tuple[int, ...] = ()  # sizes of the leading axes (layers and/or experts)


def _check_representable(spec: ModelSpec) -> None:
    """Refuse what megatron-core's ``GPTModel`` / ``BertModel`` cannot compute (one line naming the cause)."""
    cfg = spec.cfg
    if cfg.post_layernorm:  # megatron-core's TransformerLayer is pre-LN only (only BERT is post-LN)
        raise UserError(
            "torch_dist: tensor language_model.embedding.layernorm.weight (a post-LN BERT, "
            "--apply-residual-connection-post-layernorm) has no megatron-core counterpart; "
            "use --ckpt-format torch"
        )
    if spec.model_kind.has_mlm_head and cfg.gelu != "erf":  # its BertLMHead runs exact F.gelu always
        raise UserError(
            "torch_dist: a BERT with tanh GeLU (model config gelu='tanh') has no megatron-core "
            "counterpart (its BertLMHead runs exact GeLU); use --ckpt-format torch"
        )
    tanh_mlp = cfg.gelu == "tanh" and not cfg.swiglu and not cfg.squared_relu
    if tanh_mlp and not cfg.add_bias_linear:
        # megatron-core runs tanh GeLU only as its fused bias-GeLU kernel, which needs the fc1 bias
        raise UserError(
            "torch_dist: tanh GeLU without linear biases (gelu='tanh', --disable-bias-linear) has no "
            "megatron-core counterpart (it would run exact GeLU); use --ckpt-format torch"
        )


def _homogeneous(cfg: ModelConfig) -> bool:
    """megatron-core stacks layers along a leading axis only when every layer has the same kind
    of MLP; with ``--moe-layer-freq`` mixing dense and MoE layers each layer has its own keys
    (``decoder.layers.N.*``, ``non_homogeneous_layers``)."""
    kinds = {cfg.is_moe_layer(i) for i in range(cfg.num_layers)}
    return len(kinds) == 1


def _place(
    canonical: str, kind: str, cfg: ModelConfig, stacked: bool
) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """``(key, index, leading sizes)`` of one canonical tensor in the sharded state dict."""
    key, layer = to_mcore_key(canonical, kind)
    m = _LAYER.match(canonical)
    expert = to_dist_expert(m.group(2)) if m is not None else None
    if expert is not None:  # one tensor with an expert axis (SequentialMLP's sharded state dict)
        key = f"{MCORE_BLOCK[kind]}.layers.{expert[0]}"
    if layer is None:
        return key, (), ()
    index, lead = ((layer,), (cfg.num_layers,)) if stacked else ((), ())
    if not stacked:
        key = key.replace(".layers.", f".layers.{layer}.", 1)
    if expert is not None:
        index, lead = (*index, expert[1]), (*lead, int(cfg.num_experts or 0))
    return key, index, lead


def _entries(source: TensorSource, tp: int) -> list[_Entry]:
    spec = source.spec
    cfg = spec.cfg
    _check_representable(spec)
    padded = padded_vocab_size(cfg.vocab_size, tp=tp, divisible_by=cfg.make_vocab_size_divisible_by)
    slots = chunk_slots(spec, tp=1, pre_process=True, post_process=True, layer_numbers=range(cfg.num_layers))
    stacked = _homogeneous(cfg)
    grouped: dict[str, list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]]] = {}
    for slot in slots:
        key, index, lead = _place(slot.canonical, spec.kind, cfg, stacked)
        shape = (padded, *slot.shape[1:]) if slot.vocab else slot.shape
        grouped.setdefault(key, []).append((slot.canonical, index, lead, shape, slot.vocab))
    dtype = getattr(torch, cfg.params_dtype)
    out = []
    for key, items in grouped.items():
        _, _, lead, shape, vocab = items[0]
        parts = tuple((name, index) for name, index, _, _, _ in items)
        out.append(_Entry(key, (*lead, *shape), dtype, parts, padded if vocab else None, lead=lead))
    return out


def _extra_state_keys(entries: list[_Entry]) -> list[str]:
    """The ``_extra_state`` byte entries megatron-core saves: one per linear layer's weight chunk
    (``<stem>._extra_state/shard_<index>_<leading sizes>``, dotted over the layer and expert axes;
    ``shard_0_1`` for a per-layer key), plus ``output_layer._extra_state/shard_0_1`` for BERT (its
    ``BertModel`` keeps the output layer's extra state; ``GPTModel`` drops it)."""
    keys = []
    block = MCORE_BLOCK["gpt"]
    for e in entries:
        if e.state_kind is not None or not _LINEAR_WEIGHT.search(e.key):
            continue
        block = e.key.split(".")[0]
        stem = e.key.removesuffix(".weight")
        for _, index in e.parts:
            where = ".".join(map(str, index)) if index else "0"
            sizes = ".".join(map(str, e.lead)) if e.lead else "1"
            keys.append(f"{stem}._extra_state/shard_{where}_{sizes}")
    return keys + (["output_layer._extra_state/shard_0_1"] if block == MCORE_BLOCK["bert"] else [])


@dataclass(frozen=True)
class _Item:
    """One item of the save plan (dcp's ``WriteItem``): a ``chunk`` of ``entry`` (canonical tensor
    ``name``), or a byte entry ``key`` (``entry`` None)."""

    key: str
    chunk: StoredChunk | None = None
    entry: _Entry | None = None
    name: str = ""


def _plans(entries: list[_Entry], split: WorkSplit) -> list[list[_Item]]:
    """Every rank's items in plan order (each rank computes them all alone): the chunks
    :meth:`WorkSplit.owners` gives it, in entry order (one per layer / expert of a stacked key),
    then on rank 0 the ``_extra_state`` byte entries."""
    owners = iter(split.owners([_chunk_bytes(e) for e in entries for _ in e.parts]))
    plans: list[list[_Item]] = [[] for _ in range(split.world)]
    for e in entries:
        for name, index in e.parts:
            offsets = (*index, *(0,) * (len(e.shape) - len(index)))
            sizes = (*(1,) * len(index), *e.shape[len(index) :])
            plans[next(owners)].append(_Item(e.key, StoredChunk(offsets, sizes, e.shape, e.dtype), e, name))
    plans[0] += [_Item(key) for key in _extra_state_keys(entries)]
    return plans


class _ChunkMaker:
    """Each item's data when the file writer reaches it: the chunk as the source's stored blocks
    (:meth:`pieces`, where the source keeps them so), else as one tensor (:meth:`data`)."""

    def __init__(
        self, fetch: Callable[[_Entry, str], torch.Tensor],
        pieces: Callable[[_Entry, str], RowPieces | ColumnPieces | None] | None = None,
    ) -> None:  # fmt: skip
        self.fetch, self.fetch_pieces = fetch, pieces

    def __call__(self, item: _Item) -> torch.Tensor | bytes | LazyTensor:
        lazy = self.pieces(item)
        return self.data(item) if lazy is None else lazy

    def data(self, item: _Item) -> torch.Tensor | bytes:
        """A byte entry's ``torch.save([None])`` (a linear layer's empty extra state), or the chunk
        with its leading size-1 axes."""
        if item.entry is None:
            buf = io.BytesIO()
            torch.save([None], buf)
            return buf.getvalue()
        entry = item.entry
        t = self.fetch(entry, item.name).to(entry.dtype).contiguous()
        return t.reshape((1,) * len(entry.lead) + tuple(t.shape))  # its chunk of the leading axes

    def pieces(self, item: _Item) -> LazyTensor | None:
        """The chunk as the source's stored blocks, gathered into its archive; None where the
        source does not keep it so (or for a byte entry)."""
        entry = item.entry
        made = self.fetch_pieces(entry, item.name) if entry is not None and self.fetch_pieces else None
        if made is None:
            return None
        assert entry is not None
        return LazyTensor(entry.dtype, (1,) * len(entry.lead) + tuple(made.shape), lambda: made)


def _chunk_bytes(e: _Entry) -> int:
    """Bytes of one chunk of ``e`` (one layer / expert, or the whole tensor)."""
    return math.prod(e.shape[len(e.lead) :]) * e.dtype.itemsize


def _optimizer_entries(entries: list[_Entry], params_dtype: str, *, distributed: bool) -> list[_Entry]:
    """Per weight entry, its fp32 optimizer-state entries (``optimizer.state.<name>.<key>``)."""
    return [
        dataclasses.replace(
            e, key=f"{MCORE_STATE_PREFIX}.{name}.{e.key}", dtype=torch.float32, state_kind=kind
        )
        for e in entries
        for kind, name in optimizer_entry_kinds(params_dtype, distributed=distributed)
    ]


def _fetcher(source: TensorSource, opt: OptimizerSource | None) -> Callable[[_Entry, str], torch.Tensor]:
    def fetch(entry: _Entry, name: str) -> torch.Tensor:
        pad_rows = entry.pad_rows
        if entry.state_kind is None:
            full = source.tensor(name) if pad_rows is None else vocab_rows(source, name, pad_rows)
        else:
            assert opt is not None
            kind = entry.state_kind
            full = opt.state(kind, name) if pad_rows is None else opt.state_stored_rows(kind, name)[:pad_rows]
        if pad_rows is not None:  # zero rows where the source stores none
            if full.shape[0] > pad_rows:
                raise UserError(
                    f"tensor {name}: {full.shape[0]} rows exceed the padded vocabulary {pad_rows}"
                )
            if full.shape[0] < pad_rows:  # (a copy of the largest tensor: only when rows are missing)
                full = torch.cat([full, full.new_zeros((pad_rows - full.shape[0], *full.shape[1:]))])
        return full

    return fetch


def _pieces_fetcher(source: TensorSource) -> Callable[[_Entry, str], RowPieces | ColumnPieces | None]:
    def pieces(entry: _Entry, name: str) -> RowPieces | ColumnPieces | None:
        """A weight chunk as the source's stored blocks, where it keeps them as they are written
        (no cast; a vocabulary tensor's stored rows, then zero rows to the padded size, as
        :func:`_fetcher` pads it); None elsewhere."""
        if entry.state_kind is not None:
            return None
        made: RowPieces | ColumnPieces | None = None
        if isinstance(source, RowPieceSource):
            rows = source.row_pieces(name, stored=entry.pad_rows is not None)
            made = rows.padded(entry.pad_rows) if rows is not None and entry.pad_rows is not None else rows
        if made is None and isinstance(source, ColumnPieceSource) and entry.pad_rows is None:
            made = source.column_pieces(name)
        shape = tuple(entry.shape[len(entry.lead) :])
        return made if made is not None and made.dtype == entry.dtype and tuple(made.shape) == shape else None

    return pieces


def write_torch_dist(
    source: TensorSource,
    save: str | Path,
    target: ParallelConfig,
    *,
    options: WriteOptions | None = None,
    extra_files: Callable[[Path], object] | None = None,
    optimizer: OptimizerSource | None = None,
    distributed_optimizer: bool = False,
    split: WorkSplit = SINGLE,
) -> Path:
    """Write ``source`` as a ``torch_dist`` checkpoint for layout ``target`` into the new ``save``.

    ``target`` sets the vocabulary padding and the layout recorded in ``args``; the stored
    tensors are global, so megatron-core may load them at any TP/PP. ``optimizer``: its state
    is written as megatron-core's non-distributed optimizer saves it, or with
    ``distributed_optimizer`` as its ``DistributedOptimizer`` saves the ``fully_reshardable``
    format (see :mod:`pretrain.checkpoint.torch_dist.optimizer`), with the LR schedule.

    ``split``: under torchrun each process writes the chunks :meth:`WorkSplit.owners` gives it
    into its own ``__<rank>_<n>.distcp`` (as a distributed ``dcp.save`` does), the places are
    gathered over the gloo group (one ``all_gather_object``), and rank 0 writes the ``.metadata``
    of them all, ``common.pt``, ``metadata.json``, the tracker and ``extra_files``: the file set
    differs from one process's, the tensors read back do not.
    """
    source.spec.cfg.check_tensor_parallel(target.tp)
    check_expert_layout(source.spec.cfg, target, legacy=False)  # EP/ETP: recorded in args only
    entries = _entries(source, target.tp)
    options = options or WriteOptions()
    common: dict[str, Any] = {}
    if optimizer is not None:
        dtype = source.spec.cfg.params_dtype
        entries += _optimizer_entries(entries, dtype, distributed=distributed_optimizer)
        common = optimizer_common(optimizer, params_dtype=dtype, distributed=distributed_optimizer)
    meta = dataclasses.replace(_target_metadata(source, target, options), module_names="mcore")
    args: Any = to_args(meta, iteration=options.iteration)
    args.ckpt_format = "torch_dist"
    save = Path(save)
    with split.directory(save) as tmp:
        it_dir = iteration_dir(tmp, options.iteration)
        it_dir.mkdir(parents=True, exist_ok=True)
        plans = _plans(entries, split)
        fetch_pieces = _pieces_fetcher(source) if CHUNKS_FROM_PIECES else None
        make = _ChunkMaker(_fetcher(source, optimizer), fetch_pieces)
        try:
            stored = write_distcp_files(it_dir, split.rank, plans[split.rank], make)
        except OSError as exc:
            raise UserError(f"{save}: cannot write the torch_dist data ({first_line(exc)})") from None
        # (collective: a rank that failed joins it from WorkSplit.guard, and every rank stops)
        written = split.gather(stored)
        if not split.leader:
            return save
        metadata = build_metadata(
            plans, written, checkpoint_id=Path(save) / it_dir.relative_to(tmp), save_id=new_save_id()
        )
        try:
            write_dcp_metadata(it_dir, metadata)
        except OSError as exc:
            raise UserError(f"{save}: cannot write the torch_dist metadata ({first_line(exc)})") from None
        common.update(args=args, iteration=options.iteration, checkpoint_version=CHECKPOINT_VERSION)
        with atomic_open(it_dir / "common.pt", "wb") as fh:
            torch.save(common, fh)
        with atomic_open(it_dir / "metadata.json", "w") as fh:
            json.dump(METADATA_JSON, fh)
        write_tracker(tmp, options.iteration)
        if extra_files is not None:
            extra_files(tmp)
    return save
