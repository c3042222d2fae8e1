"""Read megatron-core ``torch_dist`` checkpoints (PyTorch distributed checkpoint) in one process.

An iteration directory holds ``.metadata`` (the global shapes and the chunks each writer rank
stored), ``__R_K.distcp`` data files, ``common.pt`` (args, iteration, checkpoint_version; an
upstream pickle, read with the restricted unpickler; megatron-core >= 0.19 stores the same dict as
the ``common_state`` object inside the ``.distcp`` files instead) and ``metadata.json``. Tensors are stored with
their *global* shapes, so TP/PP of the writer do not matter: fused QKV rows are already
``[groups][q heads of the group, k, v][head_dim]`` and SwiGLU ``linear_fc1`` is ``[gate; up]``
(megatron-core stores the two halves as separate shards). Layer tensors are either stacked over
layers (``decoder.layers.self_attention.linear_qkv.weight`` ``[L, ...]``) or per layer with
global indices (``decoder.layers.5....``); routed experts have an expert axis or one key each
(:mod:`pretrain.checkpoint.torch_dist.keys`). :meth:`TorchDistReader.tensor` reads only the region
of one layer (and expert) (the stored chunks that meet it, loaded over the mapped data files), so memory stays near one tensor.
The model's semantics come from ``args`` (:mod:`pretrain.model_options`), exactly as
for legacy files: norms stored zero-centred (``apply_layernorm_1p``) get 1 added, an untied
``output_layer`` is read as our ``output_layer``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint.expert_layout import expert_index
from pretrain.checkpoint.metadata import as_mapping, read_metadata
from pretrain.checkpoint.plan import ModelSpec, Slot, chunk_slots
from pretrain.checkpoint.safe_unpickle import load_untrusted, load_untrusted_bytes
from pretrain.checkpoint.torch_dist import dcp_meta
from pretrain.checkpoint.torch_dist.dcp_meta import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from pretrain.checkpoint.torch_dist.keys import Ref as _Ref
from pretrain.checkpoint.torch_dist.keys import map_keys as _map_keys
from pretrain.checkpoint.torch_dist.mapped import MappedTiles
from pretrain.checkpoint.torch_dist.storage import stored_bytes, transformed
from pretrain.checkpoint.types import CheckpointInfo, CheckpointMetadata, ColumnPieces, RowPieces
from pretrain.checkpoint.upstream.args import VocabOptions, model_kind, true_vocab_size, upstream_model_config
from pretrain.checkpoint.upstream.args_semantics import OUTPUT_LAYER, is_zero_centred_norm
from pretrain.checkpoint.vocab_view import vocab_view
from pretrain.model_options import layernorm_1p
from pretrain.models.sharding import is_vocab_tensor
from pretrain.utils.buffer_pool import pooled_empty
from pretrain.utils.errors import UserError

_GLOBAL_LAYER = re.compile(r"\.layers\.(\d+)\.")
_HEAD = "word_embeddings_for_head.weight"
_EMB = "language_model.embedding.word_embeddings.weight"
_COMMON_STATE = "common_state/shard_0_1"  # ShardedObject("common_state", (1,), (0,)).unique_key


def read_region(
    path: Path,
    md: TensorStorageMetadata,
    key: str,
    index: int | tuple[int, ...] | None,
    storage: Metadata | None = None,
    mapped: MappedTiles | None = None,
) -> torch.Tensor:
    """Tensor ``key`` (the slice at ``index`` of its leading axes: a stacked layer, an expert) of
    the checkpoint at ``path``, into CPU memory (``storage``: its ``.metadata`` already read, else
    read again; ``mapped``: its data files already mapped).

    Each stored chunk that meets the region is loaded over the mapped data file and its part of
    the region copied into place (the chunks must cover the region); a chunk with dcp storage
    transforms sends the whole region through ``dcp.load``."""
    lead = () if index is None else (index,) if isinstance(index, int) else tuple(index)
    size = (*(1,) * len(lead), *md.size[len(lead) :])
    out = pooled_empty(size, md.properties.dtype)  # a conversion's freed buffer of this size: no fresh pages
    offsets = (*lead, *(0,) * (len(size) - len(lead)))
    storage = storage if storage is not None else _read_metadata(path)
    mapped = mapped if mapped is not None else MappedTiles(path, storage)
    met = [c for c in md.chunks if _meets(c, offsets, size)]
    infos = [storage.storage_data.get(MetadataIndex(key, c.offsets)) for c in met]
    if any(i is not None and transformed(i) for i in infos):
        from pretrain.checkpoint.torch_dist.storage_dcp import dcp_read_region

        dcp_read_region(path, key, out, offsets)
        return out.reshape(md.size[len(lead) :])
    covered = 0
    for chunk, info in zip(met, infos, strict=True):
        stored = mapped.stored_chunk(key, chunk, md.properties.dtype)
        if info is None or stored is None:
            where = path / info.relative_path if info is not None else path
            raise UserError(f"{where}: cannot read tensor {key}, truncated or corrupt? (chunk at "
                            f"{tuple(chunk.offsets)} is not stored as the .metadata says)")  # fmt: skip
        covered += _copy_overlap(stored, chunk, out, offsets)
    if covered != out.numel():
        raise UserError(f"{path}: tensor {key}: the stored chunks do not cover the region at {offsets}")
    return out.reshape(md.size[len(lead) :])


def _meets(chunk: ChunkStorageMetadata, offsets: tuple[int, ...], size: tuple[int, ...]) -> bool:
    return all(
        o < c + n and c < o + s for o, s, c, n in zip(offsets, size, chunk.offsets, chunk.sizes, strict=True)
    )


def _copy_overlap(
    stored: torch.Tensor, chunk: ChunkStorageMetadata, out: torch.Tensor, offsets: tuple[int, ...]
) -> int:
    """Copy the part of the stored chunk inside the region ``out`` (at global ``offsets``) into
    place; the elements copied."""
    src, dst = stored, out
    for dim, (o, s, c, n) in enumerate(zip(offsets, out.shape, chunk.offsets, chunk.sizes, strict=True)):
        lo, hi = max(o, c), min(o + s, c + n)
        src, dst = src.narrow(dim, lo - c, hi - lo), dst.narrow(dim, lo - o, hi - lo)
    dst.copy_(src)
    return dst.numel()


@dataclass
class TorchDistReader:
    """A ``torch_dist`` checkpoint; :meth:`tensor` reads one tensor (one layer's region) at a time."""

    spec: ModelSpec
    info: CheckpointInfo
    path: Path
    meta: dict[str, TensorStorageMetadata]
    refs: dict[str, _Ref]  # canonical name -> location
    head: _Ref | None = None
    metadata: CheckpointMetadata | None = None  # our record (None for upstream checkpoints)
    storage: Metadata | None = None  # the dcp .metadata, read once (safely) when opened
    norm_1p: bool = False  # upstream apply_layernorm_1p: norm weights are stored minus 1
    args: dict[str, Any] = field(default_factory=dict)  # common.pt's args (names the tokenizer)
    common: dict[str, Any] = field(default_factory=dict)  # all of common.pt (optimizer, scheduler), read once
    mapped: MappedTiles | None = field(default=None, repr=False)  # the data files mapped, once asked for

    def names(self) -> list[str]:
        return list(self.refs)

    def with_vocab(self, vocab_size: int, *, source: str = "") -> TorchDistReader:
        """This checkpoint with the true vocabulary ``vocab_size`` (``.metadata`` not read again)."""
        row = sum(
            int(torch.Size(self.meta[r.key].size[1:]).numel())
            for n, r in self.refs.items()
            if is_vocab_tensor(n)
        )
        spec, info = vocab_view(
            self.spec, self.info, self.args, vocab_size=vocab_size, source=source, tp=1, row_numel=row
        )
        return dataclasses.replace(self, spec=spec, info=info)

    def _read(self, ref: _Ref, vocab: bool) -> torch.Tensor:
        t = read_region(self.path, self.meta[ref.key], ref.key, ref.index, self.storage, self._mapped())
        if ref.halves is not None:  # [gate; up] of a singleton SwiGLU expert
            up = read_region(
                self.path, self.meta[ref.halves], ref.halves, ref.index, self.storage, self._mapped()
            )
            t = torch.cat([t, up])
        return t[: self.spec.cfg.vocab_size] if vocab else t

    def stored_rows(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` with every stored row (a vocabulary tensor keeps its padding
        rows, trained by megatron-core, whose softmax spans them; writers carry them)."""
        if name not in self.refs:
            raise UserError(f"{self.path}: no tensor {name!r}")
        full = self._read(self.refs[name], False)
        vocab = self.spec.cfg.vocab_size
        if (
            name == _EMB
            and self.head is not None
            and not torch.equal(self._read(self.head, True), full[:vocab])
        ):
            raise UserError(
                f"{self.path}: output_layer.weight differs from {name} but args do not say "
                "untie_embeddings_and_output_weights"
            )
        if self.norm_1p and is_zero_centred_norm(name):
            full = full + 1
        return full

    def row_pieces(self, name: str, *, stored: bool = False) -> RowPieces | None:
        """:meth:`tensor` (``stored``: :meth:`stored_rows`) as the stored chunks' rows in order,
        views of the mapped files (see :mod:`~pretrain.checkpoint.torch_dist.mapped`); None where
        :meth:`tensor` does more (halves joined, the output layer's copy compared, stored norm
        offsets) or the chunks do not tile the rows."""
        views = self._stored_views(name, 0)
        if views is None:
            return None
        rows = RowPieces(tuple(views))
        return rows[: self.spec.cfg.vocab_size] if is_vocab_tensor(name) and not stored else rows

    def column_pieces(self, name: str) -> ColumnPieces | None:
        """A 2-D :meth:`tensor` as the stored chunks' column blocks in order (mapped views)."""
        views = self._stored_views(name, -1)
        if views is None or views[0].dim() != 2 or is_vocab_tensor(name):
            return None
        return ColumnPieces(tuple(views))

    def _stored_views(self, name: str, axis: int) -> list[torch.Tensor] | None:
        ref = self.refs.get(name)
        if ref is None or ref.halves is not None or self.storage is None:
            return None
        if (name == _EMB and self.head is not None) or (self.norm_1p and is_zero_centred_norm(name)):
            return None
        mapped = self._mapped()
        return None if mapped is None else mapped.tiles(ref.key, self.meta[ref.key], ref.index, axis)

    def _mapped(self) -> MappedTiles | None:
        """The data files mapped (once; None without the ``.metadata``)."""
        if self.mapped is None and self.storage is not None:
            self.mapped = MappedTiles(self.path, self.storage)
        return self.mapped

    def tensor_meta(self, name: str) -> torch.Tensor:
        """``tensor(name)``'s dtype and shape as a ``meta`` tensor, from ``.metadata`` (no data read)."""
        if name not in self.refs:
            raise UserError(f"{self.path}: no tensor {name!r}")
        ref = self.refs[name]
        md = self.meta[ref.key]
        size = tuple(md.size) if ref.layer is None else tuple(md.size[1:])
        full = torch.empty(size, dtype=md.properties.dtype, device="meta")
        return full[: self.spec.cfg.vocab_size] if is_vocab_tensor(name) else full

    def tensor(self, name: str) -> torch.Tensor:
        full = self.stored_rows(name)
        return full[: self.spec.cfg.vocab_size] if is_vocab_tensor(name) else full


def _read_metadata(it_dir: Path) -> Metadata:
    """The dcp ``.metadata`` (restricted unpickler, plain classes), its data files checked."""
    md = dcp_meta.read_dcp_metadata(it_dir)
    _check_data_files(it_dir, md.storage_data)
    return md


def _tensors(md: Metadata) -> dict[str, TensorStorageMetadata]:
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _check_data_files(it_dir: Path, storage: object) -> None:
    """Every ``.distcp`` file the metadata names exists and reaches the end of its last item.

    Tensors are read lazily, so without this a truncated file would surface only when (and if)
    a tensor stored past the cut is read: after minutes of work, or as an ``inspect`` problem.
    """
    ends: dict[str, int] = {}
    for info in storage.values() if isinstance(storage, dict) else ():
        name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if isinstance(name, str) and isinstance(offset, int) and isinstance(length, int):
            ends[name] = max(ends.get(name, 0), offset + length)
    for name, end in sorted(ends.items()):
        path = it_dir / name
        if not path.is_file():
            raise UserError(f"{path}: missing (the torch_dist .metadata stores tensors in it)")
        size = path.stat().st_size
        if size < end:
            raise UserError(
                f"{path}: truncated: {size} bytes, but the .metadata stores data up to byte {end}"
            )


def read_common(it_dir: Path, storage: Metadata | None = None) -> dict[str, Any]:
    """The non-sharded state (``args``, ``iteration``, ...): ``common.pt``, or (megatron-core >= 0.19,
    which no longer writes ``common.pt``) the ``common_state`` sharded object in the ``.distcp``
    files, a ``torch.save``d one-element list. Neither: one line (the model's args are gone)."""
    if (it_dir / "common.pt").is_file():
        return load_untrusted(it_dir / "common.pt", mmap=False)
    if storage is None:
        storage = _read_metadata(it_dir)
    if _COMMON_STATE not in storage.state_dict_metadata:
        raise UserError(
            f"{it_dir}: common.pt is missing (it holds the args that describe the model; "
            f"megatron-core >= 0.19 keeps them as {_COMMON_STATE} in the .distcp files, absent too)"
        )
    info = storage.storage_data.get(MetadataIndex(_COMMON_STATE))
    if info is None or transformed(info):  # dcp reads what it transformed
        from pretrain.checkpoint.torch_dist.storage_dcp import dcp_read_bytes

        data = dcp_read_bytes(it_dir, _COMMON_STATE)
    else:
        data = stored_bytes(it_dir / info.relative_path, info)
    loaded = load_untrusted_bytes(data, source=f"{it_dir} {_COMMON_STATE}")
    state = loaded[0] if isinstance(loaded, list | tuple) and len(loaded) == 1 else loaded
    if not isinstance(state, dict):
        raise UserError(f"{it_dir}: {_COMMON_STATE} holds a {type(state).__name__}, expected a dict")
    return state


def _check_slots(
    it_dir: Path, slots: list[Slot], refs: dict[str, _Ref], shapes: dict[str, tuple[int, ...]]
) -> None:
    """Every tensor the model needs is stored, with its shape (vocabulary rows aside)."""
    by_local = {s.local: s for s in slots}
    missing = sorted(set(by_local) - set(refs))
    beyond = sorted(n for n in set(refs) - set(by_local) if expert_index(n) is not None)
    if beyond:  # the args' num_experts disagrees with the expert tensors
        raise UserError(
            f"{it_dir}: tensor {refs[beyond[0]].key} holds expert {expert_index(beyond[0])} "
            f"({beyond[0]}), which the model (args num_experts, --moe-layer-freq) does not have"
        )
    if missing:
        raise UserError(f"{it_dir}: torch_dist checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    for name, slot in by_local.items():
        want = slot.shape[1:] if slot.vocab else slot.shape
        have = shapes[name][1:] if slot.vocab else shapes[name]
        if tuple(have) != tuple(want):
            raise UserError(
                f"{it_dir}: tensor {refs[name].key} has shape {shapes[name]}, expected {slot.shape}"
            )


def _num_parameters(slots: list[Slot], vocab_size: int) -> int:
    """Parameters of the model, vocabulary tensors counted at the true vocabulary size."""
    return sum(int(torch.Size((vocab_size, *s.shape[1:]) if s.vocab else s.shape).numel()) for s in slots)


def open_torch_dist(
    it_dir: Path,
    iteration: int | str | None,
    *,
    vocab: VocabOptions | None = None,
    root: Path | None = None,
) -> TorchDistReader:
    """Open a ``torch_dist`` iteration directory (metadata only; tensors are read on demand)."""
    storage = _read_metadata(it_dir)
    meta = _tensors(storage)
    common = read_common(it_dir, storage)
    args = dict(as_mapping(common.get("args")))
    ours = read_metadata(args, source=str(it_dir))
    refs, shapes = _map_keys(meta)
    if _EMB not in refs:
        raise UserError(
            f"{it_dir}: no word embeddings among the torch_dist keys (not a GPT/BERT checkpoint?)"
        )
    probes = {
        n: torch.empty(s, dtype=meta[refs[n].key].properties.dtype, device="meta") for n, s in shapes.items()
    }
    kind = ours.kind if ours is not None else model_kind(args, set(refs))
    padded = shapes[_EMB][0]
    size, how = true_vocab_size(args, padded, tp=1, vocab=vocab or VocabOptions(), source=str(it_dir))
    layers = 1 + max((int(m.group(1)) for n in refs if (m := _GLOBAL_LAYER.search(n))), default=-1)
    source = str(it_dir)
    if ours is not None:
        cfg = dataclasses.replace(ours.model, vocab_size=size)
    else:
        cfg = upstream_model_config(
            args, probes, kind=kind, tp=1, vocab_size=size, num_layers=layers, source=source
        )
    head = refs.pop(_HEAD, None)
    if cfg.untie_embeddings_and_output_weights and head is not None:
        refs[OUTPUT_LAYER], shapes[OUTPUT_LAYER], head = head, shapes[_HEAD], None
    spec = ModelSpec(kind=kind, cfg=cfg, add_binary_head=any(n.startswith("binary_head.") for n in refs))
    slots = chunk_slots(spec, tp=1, pre_process=True, post_process=True, layer_numbers=range(cfg.num_layers))
    _check_slots(it_dir, slots, refs, shapes)
    dtypes = sorted({str(meta[r.key].properties.dtype).removeprefix("torch.") for r in refs.values()})
    info = CheckpointInfo(
        path=source, format="torch_dist", iteration=common.get("iteration", iteration),
        checkpoint_version=float(common.get("checkpoint_version", 3.0) or 0), kind=kind,
        tp=int(args.get("tensor_model_parallel_size") or 1), pp=int(args.get("pipeline_model_parallel_size") or 1),
        vp=int(args.get("virtual_pipeline_model_parallel_size") or 1), ep=int(args.get("expert_model_parallel_size") or 1),
        vocab_size=cfg.vocab_size,
        vocab_source=how, padded_vocab_size=padded, num_parameters=_num_parameters(slots, cfg.vocab_size),
        dtypes=tuple(dtypes), ours=ours is not None, root=str(root or ""), vocab_known=not how.startswith("padded"),
    )  # fmt: skip
    ordered = {s.canonical: refs[s.local] for s in slots}
    return TorchDistReader(
        spec=spec, info=info, path=it_dir, meta=meta, refs=ordered, head=head, metadata=ours, storage=storage,
        norm_1p=ours is None and layernorm_1p(args), args=args, common=common,
    )  # fmt: skip
