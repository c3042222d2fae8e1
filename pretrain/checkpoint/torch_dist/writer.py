"""Write canonical full tensors as a megatron-core ``torch_dist`` checkpoint, streaming.

The output is what ``megatron.core.dist_checkpointing.save`` writes for a ``GPTModel`` or a
``BertModel`` (local spec; layers under ``decoder`` / ``encoder``), so
megatron-core's ``dist_checkpointing.load`` (and Megatron-LM ``--ckpt-format torch_dist``) accept
it at any TP/PP: ``ROOT/latest_checkpointed_iteration.txt`` and ``ROOT/iter_N/`` with

* ``.metadata`` + ``__0_0.distcp``: a PyTorch distributed checkpoint keyed by megatron-core's
  sharded-state-dict keys (:func:`~pretrain.checkpoint.upstream.names.to_mcore_key`): global
  shapes, layers stacked along a leading axis ``[num_layers, ...]`` and stored one chunk per layer
  (the chunks megatron-core itself writes along that axis); the word embeddings (and an untied
  ``output_layer``, and BERT's MLM output bias ``output_layer.bias``) padded for the target TP; the ``_extra_state`` byte entries of every linear
  layer (``<key>/shard_<layer>_<num_layers>``, holding ``[None]`` as the local spec saves them);
* ``common.pt``: ``args`` (Megatron-LM's Namespace with our record, see
  :mod:`pretrain.checkpoint.metadata`), ``iteration``, ``checkpoint_version``;
* ``metadata.json``: the backend names megatron-core checks.

A custom save planner asks the source for each layer's tensor only when the file writer reaches
it, so memory stays near one tensor. The directory is built under a temporary sibling and renamed
at the end (nothing half-written).
"""

from __future__ import annotations

import dataclasses
import io
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from pretrain.checkpoint.legacy.layout import CHECKPOINT_VERSION, iteration_dir, write_tracker
from pretrain.checkpoint.legacy.writer import WriteOptions, _target_metadata, vocab_rows
from pretrain.checkpoint.metadata import to_args
from pretrain.checkpoint.optimizer.state import MCORE_STATE_PREFIX, OptimizerSource
from pretrain.checkpoint.plan import ModelSpec, chunk_slots
from pretrain.checkpoint.torch_dist.dcp_failures import dcp_failures, first_line
from pretrain.checkpoint.torch_dist.optimizer import optimizer_common, optimizer_entry_kinds
from pretrain.checkpoint.types import TensorSource
from pretrain.checkpoint.upstream.names import MCORE_BLOCK, to_mcore_key
from pretrain.config import ParallelConfig
from pretrain.tensor_parallel.vocab import padded_vocab_size
from pretrain.utils.atomic import atomic_directory, atomic_open
from pretrain.utils.errors import UserError

METADATA_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
_EXTRA_STATE = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class _Entry:
    """One stored tensor key: its global shape and, per chunk, the canonical tensor it comes from."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[tuple[str, int | None], ...]  # (canonical name, layer) per chunk; layer None: whole
    pad_rows: int | None  # vocabulary tensors: padded row count
    state_kind: str | None = None  # an optimizer state ("exp_avg", ...) of the weight; None: the weight


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


def _entries(source: TensorSource, tp: int) -> list[_Entry]:
    spec = source.spec
    cfg = spec.cfg
    _check_representable(spec)
    padded = padded_vocab_size(cfg.vocab_size, tp=tp, divisible_by=cfg.make_vocab_size_divisible_by)
    slots = chunk_slots(spec, tp=1, pre_process=True, post_process=True, layer_numbers=range(cfg.num_layers))
    grouped: dict[str, list[tuple[str, int | None, tuple[int, ...], bool]]] = {}
    for slot in slots:
        key, layer = to_mcore_key(slot.canonical, spec.kind)
        shape = (padded, *slot.shape[1:]) if slot.vocab else slot.shape
        grouped.setdefault(key, []).append((slot.canonical, layer, shape, slot.vocab))
    dtype = getattr(torch, cfg.params_dtype)
    out = []
    for key, items in grouped.items():
        layered = items[0][1] is not None
        shape = (len(items), *items[0][2]) if layered else items[0][2]
        parts = tuple((name, layer) for name, layer, _, _ in items)
        out.append(_Entry(key, shape, dtype, parts, padded if items[0][3] else None))
    return out


def _extra_state_keys(entries: list[_Entry], num_layers: int) -> list[str]:
    """The ``_extra_state`` byte entries megatron-core saves: each linear layer of every layer
    (``<block>.layers.<module>.<linear>._extra_state/shard_<layer>_<num_layers>``, the block read
    off the stacked keys), plus ``output_layer._extra_state/shard_0_1`` for BERT (its
    ``BertModel`` keeps the output layer's extra state; ``GPTModel`` drops it)."""
    block = next((e.key.split(".")[0] for e in entries if e.parts[0][1] is not None), "decoder")
    keys = [
        f"{block}.layers.{'mlp' if 'fc' in stem else 'self_attention'}.{stem}._extra_state"
        f"/shard_{layer}_{num_layers}"
        for stem in _EXTRA_STATE
        for layer in range(num_layers)
    ]
    return keys + (["output_layer._extra_state/shard_0_1"] if block == MCORE_BLOCK["bert"] else [])


class _StreamingPlanner(DefaultSavePlanner):
    """Save plan built from the entries; each chunk is fetched from the source when written."""

    def __init__(self, entries: list[_Entry], fetch: Callable[[_Entry, str], torch.Tensor]) -> None:
        super().__init__()
        self.entries, self.fetch = entries, fetch
        self.chunk_of: dict[tuple[str, tuple[int, ...]], tuple[str, _Entry]] = {}
        self.num_layers = max((e.shape[0] for e in entries if e.parts[0][1] is not None), default=0)

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for e in self.entries:
            props = TensorProperties(dtype=e.dtype)
            for name, layer in e.parts:
                offsets = (0,) * len(e.shape) if layer is None else (layer, *(0,) * (len(e.shape) - 1))
                sizes = e.shape if layer is None else (1, *e.shape[1:])
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                index = MetadataIndex(e.key, torch.Size(offsets))
                self.chunk_of[(e.key, tuple(offsets))] = (name, e)
                items.append(WriteItem(index=index, type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=chunk, properties=props,
                                                                   size=torch.Size(e.shape))))  # fmt: skip
        for key in _extra_state_keys(self.entries, self.num_layers):
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items, planner_data={})
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save([None], buf)
            buf.seek(0)
            return buf
        key, offsets = write_item.index.fqn, tuple(write_item.index.offset or ())
        name, entry = self.chunk_of[(key, offsets)]
        t = self.fetch(entry, name).to(entry.dtype).contiguous()
        return t if entry.parts[0][1] is None else t.unsqueeze(0)


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
            full = torch.cat([full, full.new_zeros((pad_rows - full.shape[0], *full.shape[1:]))])
        return full

    return fetch


def write_torch_dist(
    source: TensorSource,
    save: str | Path,
    target: ParallelConfig,
    *,
    options: WriteOptions | None = None,
    extra_files: Callable[[Path], object] | None = None,
    optimizer: OptimizerSource | None = None,
    distributed_optimizer: bool = False,
) -> Path:
    """Write ``source`` as a ``torch_dist`` checkpoint for layout ``target`` into the new ``save``.

    ``target`` sets the vocabulary padding and the layout recorded in ``args``; the stored
    tensors are global, so megatron-core may load them at any TP/PP. ``optimizer``: its state
    is written as megatron-core's non-distributed optimizer saves it, or with
    ``distributed_optimizer`` as its ``DistributedOptimizer`` saves the ``fully_reshardable``
    format (see :mod:`pretrain.checkpoint.torch_dist.optimizer`), with the LR schedule.
    """
    source.spec.cfg.check_tensor_parallel(target.tp)
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
    with atomic_directory(save) as tmp:
        it_dir = iteration_dir(tmp, options.iteration)
        it_dir.mkdir(parents=True)
        written = dcp_failures(lambda exc: f"{save}: cannot write the torch_dist data ({first_line(exc)})")
        with written, warnings.catch_warnings():  # "assuming ... a single process": intended
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({}, storage_writer=FileSystemWriter(str(it_dir), thread_count=1),
                     planner=_StreamingPlanner(entries, _fetcher(source, optimizer)), no_dist=True)  # fmt: skip
        common.update(args=args, iteration=options.iteration, checkpoint_version=CHECKPOINT_VERSION)
        with atomic_open(it_dir / "common.pt", "wb") as fh:
            torch.save(common, fh)
        with atomic_open(it_dir / "metadata.json", "w") as fh:
            json.dump(METADATA_JSON, fh)
        write_tracker(tmp, options.iteration)
        if extra_files is not None:
            extra_files(tmp)
    return save
