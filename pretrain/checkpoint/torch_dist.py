"""Read megatron-core ``torch_dist`` checkpoints (PyTorch distributed checkpoint) in one process.

An iteration directory holds ``.metadata`` (the global shapes), ``__R_K.distcp`` data files,
``common.pt`` (args, iteration, checkpoint_version; an upstream pickle, read with the restricted
unpickler) and ``metadata.json``. Tensors are stored with their *global* shapes, so TP/PP of the
writer do not matter: fused QKV rows are already ``[heads][3][head_dim]``. Layer tensors are
either stacked over layers (``decoder.layers.self_attention.linear_qkv.weight`` ``[L, 3h, h]``)
or per layer with global indices (``decoder.layers.5....``). Each tensor is read on demand
with ``torch.distributed.checkpoint.load`` into a CPU tensor of its global shape.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pretrain.checkpoint.plan import ModelSpec, chunk_slots
from pretrain.checkpoint.reader import CheckpointInfo
from pretrain.checkpoint.safe_unpickle import load_untrusted
from pretrain.checkpoint.upstream_args import (
    model_kind,
    our_model_config,
    true_vocab_size,
    upstream_model_config,
)
from pretrain.checkpoint.upstream_names import to_local_name
from pretrain.models.sharding import is_vocab_tensor
from pretrain.utils.errors import UserError

_STACKED = re.compile(r"^(.*?\blayers)\.(?!\d)(.*)$")
_GLOBAL_LAYER = re.compile(r"\.layers\.(\d+)\.")
_HEAD = "word_embeddings_for_head.weight"
_EMB = "language_model.embedding.word_embeddings.weight"


@dataclass(frozen=True)
class _Ref:
    key: str  # the torch_dist key
    layer: int | None  # index into the leading (stacked) dimension


def _map_keys(meta: dict[str, TensorStorageMetadata]) -> tuple[dict[str, _Ref], dict[str, tuple[int, ...]]]:
    """Our full-model local names (global layer indices) -> where they live; and stacked sizes."""
    refs: dict[str, _Ref] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for key, md in meta.items():
        stacked = _STACKED.match(key)
        if stacked is not None:
            template = to_local_name(f"{stacked.group(1)}.0.{stacked.group(2)}")
            if template is None:
                continue
            for i in range(md.size[0]):
                name = template.replace(".layers.0.", f".layers.{i}.", 1)
                refs[name], shapes[name] = _Ref(key, i), tuple(md.size[1:])
        else:
            local = to_local_name(key)
            if local is not None:
                refs[local], shapes[local] = _Ref(key, None), tuple(md.size)
    return refs, shapes


@dataclass
class TorchDistReader:
    """A ``torch_dist`` checkpoint; :meth:`tensor` reads one tensor (its stacked key) at a time."""

    spec: ModelSpec
    info: CheckpointInfo
    path: Path
    meta: dict[str, TensorStorageMetadata]
    refs: dict[str, _Ref]  # canonical name -> location
    head: _Ref | None = None
    _cache: dict[str, torch.Tensor] = field(default_factory=dict)

    def names(self) -> list[str]:
        return list(self.refs)

    def _load_key(self, key: str) -> torch.Tensor:
        if key not in self._cache:
            self._cache.clear()  # keep one stacked tensor: memory stays near one key
            md = self.meta[key]
            out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            try:
                with warnings.catch_warnings():  # "assuming ... a single process": intended
                    warnings.simplefilter("ignore", UserWarning)
                    dcp.load({key: out}, storage_reader=FileSystemReader(str(self.path)), no_dist=True)
            except Exception as exc:
                raise UserError(
                    f"{self.path}: cannot read tensor {key} ({type(exc).__name__}: {exc})"
                ) from None
            self._cache[key] = out
        return self._cache[key]

    def _read(self, ref: _Ref, vocab: bool) -> torch.Tensor:
        t = self._load_key(ref.key)
        t = t if ref.layer is None else t[ref.layer]
        return t[: self.spec.cfg.vocab_size] if vocab else t

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.refs:
            raise UserError(f"{self.path}: no tensor {name!r}")
        vocab = is_vocab_tensor(name)
        full = self._read(self.refs[name], vocab).clone()
        if name == _EMB and self.head is not None and not torch.equal(self._read(self.head, True), full):
            raise UserError(
                f"{self.path}: output_layer.weight differs from {name}; untied output layers are not supported"
            )
        return full


def _read_metadata(it_dir: Path) -> dict[str, TensorStorageMetadata]:
    try:
        md = FileSystemReader(str(it_dir)).read_metadata()
    except Exception as exc:
        raise UserError(f"{it_dir}: cannot read torch_dist metadata ({type(exc).__name__}: {exc})") from None
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def open_torch_dist(
    it_dir: Path,
    iteration: int | str | None,
    *,
    vocab_size: int | None = None,
    tokenizer_dir: str | Path | None = None,
) -> TorchDistReader:
    """Open a ``torch_dist`` iteration directory (metadata only; tensors are read on demand)."""
    common = load_untrusted(it_dir / "common.pt", mmap=False) if (it_dir / "common.pt").exists() else {}
    args = dict(common.get("args") or {})
    meta = _read_metadata(it_dir)
    refs, shapes = _map_keys(meta)
    if _EMB not in refs:
        raise UserError(
            f"{it_dir}: no word embeddings among the torch_dist keys (not a GPT/BERT checkpoint?)"
        )
    probes = {
        n: torch.empty(s, dtype=meta[refs[n].key].properties.dtype, device="meta") for n, s in shapes.items()
    }
    kind = model_kind(args, set(refs))
    padded = shapes[_EMB][0]
    vocab, how = true_vocab_size(args, padded, override=vocab_size, tokenizer_dir=tokenizer_dir)
    layers = 1 + max((int(m.group(1)) for n in refs if (m := _GLOBAL_LAYER.search(n))), default=-1)
    source = str(it_dir)
    if isinstance(args.get("mlm_toolkit"), dict):
        cfg = our_model_config(args, vocab_size=vocab, source=source)
    else:
        cfg = upstream_model_config(
            args, probes, kind=kind, tp=1, vocab_size=vocab, num_layers=layers, source=source
        )
    spec = ModelSpec(kind=kind, cfg=cfg, add_binary_head=any(n.startswith("binary_head.") for n in refs))
    slots = chunk_slots(spec, tp=1, pre_process=True, post_process=True, layer_numbers=range(cfg.num_layers))
    by_local = {s.local: s for s in slots}
    missing = sorted(set(by_local) - set(refs))
    if missing:
        raise UserError(f"{it_dir}: torch_dist checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    for name, slot in by_local.items():
        want = slot.shape[1:] if slot.vocab else slot.shape
        have = shapes[name][1:] if slot.vocab else shapes[name]
        if tuple(have) != tuple(want):
            raise UserError(
                f"{it_dir}: tensor {refs[name].key} has shape {shapes[name]}, expected {slot.shape}"
            )
    dtypes = sorted({str(meta[r.key].properties.dtype).removeprefix("torch.") for r in refs.values()})
    info = CheckpointInfo(
        path=source,
        format="torch_dist",
        iteration=common.get("iteration", iteration),
        checkpoint_version=float(common.get("checkpoint_version", 3.0) or 0),
        kind=kind,
        tp=int(args.get("tensor_model_parallel_size") or 1),
        pp=int(args.get("pipeline_model_parallel_size") or 1),
        vp=int(args.get("virtual_pipeline_model_parallel_size") or 1),
        vocab_size=cfg.vocab_size,
        vocab_source=how,
        padded_vocab_size=padded,
        num_parameters=sum(
            int(torch.Size((cfg.vocab_size, *s.shape[1:]) if s.vocab else s.shape).numel()) for s in slots
        ),
        dtypes=tuple(dtypes),
        ours=isinstance(args.get("mlm_toolkit"), dict),
    )
    ordered = {s.canonical: refs[s.local] for s in slots}
    return TorchDistReader(spec=spec, info=info, path=it_dir, meta=meta, refs=ordered, head=refs.get(_HEAD))
