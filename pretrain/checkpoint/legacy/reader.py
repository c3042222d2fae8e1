"""The reader of legacy-format (``torch``) iteration directories: canonical full tensors on demand.

:func:`open_legacy` accepts our checkpoints and upstream Megatron-LM ones of every era
(checkpoint_version 0 to 3.0, old and megatron-core names, ``release`` directories, pipeline
stages and virtual chunks). Rank files are loaded with ``torch.load(mmap=True)`` through the
restricted unpickler, so opening costs little memory and :meth:`LegacyReader.tensor` materialises
one full tensor at a time. Callers use :func:`pretrain.checkpoint.opener.open_checkpoint`, which
dispatches here or to the ``torch_dist`` reader.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint.expert_layout import ExpertShare
from pretrain.checkpoint.legacy.expert_files import check_expert_files, expert_tp_of, merge_expert_ranks
from pretrain.checkpoint.legacy.layout import (
    MODEL_FILE,
    first_rank_dir,
    flatten,
    list_expert_rank_dirs,
    rank_dir_name,
)
from pretrain.checkpoint.legacy.pages import PageReleaser
from pretrain.checkpoint.metadata import CheckpointMetadata, as_mapping, read_metadata
from pretrain.checkpoint.plan import ModelSpec, Slot, chunk_slots, layers_from_counts
from pretrain.checkpoint.safe_unpickle import load_untrusted
from pretrain.checkpoint.types import CheckpointInfo, ColumnPieces, RowPieces
from pretrain.checkpoint.upstream.args import VocabOptions, model_kind, true_vocab_size, upstream_model_config
from pretrain.checkpoint.upstream.args_semantics import is_zero_centred_norm, untie_head_names
from pretrain.checkpoint.upstream.names import is_qkv, qkv_to_canonical, to_local_name
from pretrain.checkpoint.vocab_view import vocab_view
from pretrain.model_options import layernorm_1p
from pretrain.models.sharding import row_layout, row_order, unshard_tensors
from pretrain.utils.errors import UserError

__all__ = ["CheckpointInfo", "LegacyReader", "open_legacy"]
_CHUNK_KEY = re.compile(r"^model(\d*)$")
_LOCAL_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass
class _Entry:
    slot: Slot
    parts: list[tuple[int, str, str]]  # per TP rank: (file index, chunk key, flat key)


@dataclass
class LegacyReader:
    """A legacy-format checkpoint, opened lazily (see :func:`open_checkpoint`)."""

    spec: ModelSpec
    info: CheckpointInfo
    files: list[Path]
    states: list[dict[str, Any]]
    flats: list[dict[str, dict[str, torch.Tensor]]]  # per file: chunk key -> flat tensors
    entries: dict[str, _Entry]
    head_copies: dict[str, _Entry] = field(default_factory=dict)
    pages: PageReleaser | None = None  # drops read parts from RSS (mmap'd files)
    metadata: CheckpointMetadata | None = None  # our record (None for upstream checkpoints)
    norm_1p: bool = False  # upstream apply_layernorm_1p: norm weights are stored minus 1

    @property
    def args(self) -> dict[str, Any]:
        return dict(as_mapping(self.states[0].get("args")))

    def names(self) -> list[str]:
        return list(self.entries)

    def with_vocab(self, vocab_size: int, *, source: str = "") -> LegacyReader:
        """This checkpoint with the true vocabulary ``vocab_size`` (files not read again)."""
        row = sum(int(torch.Size(e.slot.shape[1:]).numel()) for e in self.entries.values() if e.slot.vocab)
        spec, info = vocab_view(
            self.spec,
            self.info,
            self.args,
            vocab_size=vocab_size,
            source=source,
            tp=self.info.tp,
            row_numel=row,
        )
        return dataclasses.replace(self, spec=spec, info=info)

    def _part(self, ref: tuple[int, str, str]) -> torch.Tensor:
        i, chunk, key = ref
        return self.flats[i][chunk][key]

    def _checked_parts(self, name: str, entry: _Entry) -> list[torch.Tensor]:
        """The entry's stored shards, each of the shape its slot expects (``UserError`` naming the file)."""
        slot, tp = entry.slot, self.info.tp
        parts = [self._part(ref) for ref in entry.parts]
        for ref, part in zip(entry.parts, parts, strict=True):
            want = list(slot.shape)
            if slot.vocab:
                want[0] = self.info.padded_vocab_size // tp
            if list(part.shape) != want:
                raise UserError(
                    f"{self.files[ref[0]]}: tensor {ref[2]} ({name}) has shape {tuple(part.shape)}, "
                    f"expected {tuple(want)}"
                )
        return parts

    def row_pieces(self, name: str, *, stored: bool = False) -> RowPieces | None:
        """:meth:`tensor` (``stored``: :meth:`stored_rows`) as its shards' rows in order, where
        joining them only stacks rows (column-parallel tensors, SwiGLU's blocks, QKV groups whole
        on each rank): the weights fingerprint hashes them, and writers write them, where they lie
        instead of joining a copy. None where :meth:`tensor` does more (row-parallel joins,
        replicated or old-order QKV, expert shards, stored norm offsets, a separate output-layer
        copy to compare)."""
        entry = self.entries.get(name)
        if entry is None or name in self.head_copies:
            return None
        slot, cfg = entry.slot, self.spec.cfg
        if (
            slot.dim != 0
            or slot.shards is not None
            or (is_qkv(slot.local) and self.info.checkpoint_version < 2.0)
        ):
            return None
        parts = self._checked_parts(name, entry)
        ordered = row_order(parts, layout=row_layout(slot.local, cfg))  # the join's own order
        if ordered is None or not all(p.is_contiguous() for p in parts):
            return None
        # their pages are dropped from RSS once hashed, as after a join
        release = None if self.pages is None else functools.partial(_release_parts, self.pages, parts)
        rows = RowPieces(tuple(ordered), release)
        return rows[: cfg.vocab_size] if slot.vocab and not stored else rows

    def column_pieces(self, name: str) -> ColumnPieces | None:
        """:meth:`tensor` as its TP shards' column blocks in order, where joining them is a plain
        concatenation along dim 1 of 2-D shards (row-parallel linears: ``o_proj``, ``down_proj``):
        a writer gathers each row from the mapped files instead of joining a copy. None elsewhere
        (one shard, expert shards, a separate output-layer copy)."""
        entry = self.entries.get(name)
        if entry is None or name in self.head_copies or len(entry.parts) < 2:
            return None
        slot = entry.slot
        if slot.dim != 1 or slot.shards is not None or slot.vocab:
            return None
        parts = self._checked_parts(name, entry)
        if not all(p.dim() == 2 and p.is_contiguous() for p in parts):
            return None
        release = None if self.pages is None else functools.partial(_release_parts, self.pages, parts)
        return ColumnPieces(tuple(parts), release)

    def _assemble(self, name: str, entry: _Entry) -> torch.Tensor:
        cfg, slot, tp = self.spec.cfg, entry.slot, self.info.tp
        parts = self._checked_parts(name, entry)
        if is_qkv(slot.local) and self.info.checkpoint_version < 2.0:
            heads = cfg.num_attention_heads // tp
            v = self.info.checkpoint_version
            parts = [qkv_to_canonical(p, version=v, heads=heads, head_dim=cfg.head_dim) for p in parts]
        if slot.shards is not None and slot.dim is not None:  # ETP shard t % ETP in TP rank t's file
            parts = self._expert_shards(name, entry, parts, slot.shards)
        if slot.dim is None:
            for ref, part in zip(entry.parts[1:], parts[1:], strict=True):
                if not torch.equal(part, parts[0]):
                    raise UserError(
                        f"tensor {name}: replicated copies differ between {self.files[entry.parts[0][0]]} "
                        f"and {self.files[ref[0]]}"
                    )
            full = parts[0]
        else:
            lay = row_layout(slot.local, cfg)  # SwiGLU [gate; up] per rank, GQA groups
            full = unshard_tensors(parts, dim=slot.dim, layout=lay)  # (a conversion's pooled buffer)
        if self.pages is not None:  # transparent: a later access faults the pages back in
            for part in parts:
                self.pages.release(part)
        if self.norm_1p and is_zero_centred_norm(name):  # args.apply_layernorm_1p: stored gamma - 1
            full = full + 1
        return full

    def _expert_shards(
        self, name: str, entry: _Entry, parts: list[torch.Tensor], shards: int
    ) -> list[torch.Tensor]:
        """The ``shards`` distinct ETP shards of a routed expert among its TP ranks' files (file
        t holds shard ``t % shards``), each replica checked equal to the first."""
        for t in range(shards, len(parts)):
            if not torch.equal(parts[t], parts[t % shards]):
                raise UserError(
                    f"tensor {name}: expert-TP shard {t % shards} differs between "
                    f"{self.files[entry.parts[t % shards][0]]} and {self.files[entry.parts[t][0]]}"
                )
        return parts[:shards]

    def stored_rows(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` with every stored row: a vocabulary tensor keeps its padding
        rows after the true vocabulary (``[p, h]``). megatron-core's softmax spans the padded
        vocabulary, so upstream runs train those rows; writers carry them
        (:func:`pretrain.checkpoint.legacy.writer.vocab_rows`)."""
        if name not in self.entries:
            raise UserError(f"{self.info.path}: no tensor {name!r}")
        vocab = self.spec.cfg.vocab_size if self.entries[name].slot.vocab else None
        full = self._assemble(name, self.entries[name])
        if name in self.head_copies:  # the copies agree on the rows the model uses
            head = self._assemble(name, self.head_copies[name])
            if not torch.equal(head[:vocab], full[:vocab]):
                where = self.files[self.head_copies[name].parts[0][0]]
                raise UserError(
                    f"{where}: the output layer (word_embeddings_for_head) differs from {name}; "
                    "untied output layers are not supported"
                )
        return full

    def tensor_meta(self, name: str) -> torch.Tensor:
        """``tensor(name)``'s dtype and shape as a ``meta`` tensor, from the mapped parts' (no data read)."""
        if name not in self.entries:
            raise UserError(f"{self.info.path}: no tensor {name!r}")
        slot = self.entries[name].slot
        parts = [
            torch.empty(p.shape, dtype=p.dtype, device="meta")
            for p in map(self._part, self.entries[name].parts)
        ][: slot.shards]  # a routed expert at ETP != TP: the first ETP files hold every shard
        lay = row_layout(slot.local, self.spec.cfg) if slot.dim is not None and len(parts) > 1 else None
        if slot.dim is None or len(parts) == 1:
            full = parts[0]
        elif lay is None or lay.groups is None or len(parts) <= lay.groups:
            # the shards joined along dim (SwiGLU blocks only reorder rows): the shape, no meta ops
            shape = list(parts[0].shape)
            shape[slot.dim] = sum(p.shape[slot.dim] for p in parts)
            full = torch.empty(shape, dtype=parts[0].dtype, device="meta")
        else:
            full = unshard_tensors(parts, dim=slot.dim, layout=lay, replicas="first")
        return full[: self.spec.cfg.vocab_size] if slot.vocab else full

    def tensor(self, name: str) -> torch.Tensor:
        """The canonical full tensor ``name`` (vocab rows trimmed), checked across shards."""
        full = self.stored_rows(name)
        return full[: self.spec.cfg.vocab_size] if self.entries[name].slot.vocab else full

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.entries:
            yield name, self.tensor(name)


def _release_parts(pages: PageReleaser, parts: list[torch.Tensor]) -> None:
    for part in parts:
        pages.release(part)


def _rank_grid(it_dir: Path, args: dict[str, Any]) -> tuple[int, int, int, dict[tuple[int, int, int], Path]]:
    """(tp, pp, ep, rank directories by (tp_rank, pp_rank, ep_rank)), every one present."""
    ep = int(args.get("expert_model_parallel_size") or 1)
    dirs = list_expert_rank_dirs(it_dir, pp=int(args.get("pipeline_model_parallel_size") or 1), ep=ep)
    tp = max(max(t for t, _, _ in dirs) + 1, int(args.get("tensor_model_parallel_size") or 1))
    pp = max(max(p for _, p, _ in dirs) + 1, int(args.get("pipeline_model_parallel_size") or 1))
    pp_named = ep == 1 and any(p.name.count("_") == 3 for p in dirs.values())
    grid = [(t, p, e) for p in range(pp) for t in range(tp) for e in range(ep)]
    missing = [key for key in grid if key not in dirs]
    if missing:
        names = [
            rank_dir_name(t, p, 2 if pp > 1 or pp_named else 1, e if ep > 1 else None) for t, p, e in missing
        ]
        where = f"tp={tp}, pp={pp}" + (f", ep={ep}" if ep > 1 else "")
        raise UserError(f"{it_dir}: missing shard directories {', '.join(names)} ({where})")
    return tp, pp, ep, dirs


def _chunk_keys(state: dict[str, Any], path: Path) -> list[str]:
    keys = [k for k in state if _CHUNK_KEY.match(k) and isinstance(state[k], dict)]
    if not keys:
        raise UserError(f"{path}: no model state (no 'model' or 'model0' entry)")
    if keys == ["model"]:
        return keys
    keys = sorted((k for k in keys if k != "model"), key=lambda k: int(k[5:]))
    if [int(k[5:]) for k in keys] != list(range(len(keys))):
        raise UserError(f"{path}: virtual chunks {keys} are not model0..model{len(keys) - 1}")
    return keys


def _local_names(flat: dict[str, torch.Tensor]) -> dict[str, str]:
    """Our local name -> the file's flat key, for one model chunk."""
    out: dict[str, str] = {}
    for key in flat:
        local = to_local_name(key)
        if local is not None:
            out[local] = key
    return out


def _layer_count(names: dict[str, str]) -> int:
    found = [int(m.group(1)) for n in names if (m := _LOCAL_LAYER.search(n))]
    return max(found) + 1 if found else 0


def _model_spec(
    states: list[dict[str, Any]],
    first_flat: dict[str, torch.Tensor],
    locals_: dict[tuple[int, int, int], dict[str, str]],
    counts: list[list[int]],
    tp: int,
    *,
    vocab: VocabOptions,
    source: str,
) -> tuple[ModelSpec, int, str, CheckpointMetadata | None]:
    args = dict(as_mapping(states[0].get("args")))
    meta = read_metadata(args, source=source)
    pp, vp = len(counts), len(counts[0])
    first = {n: first_flat[k] for n, k in locals_[(0, 0, 0)].items()}
    last_names = locals_[(0, pp - 1, vp - 1)]
    kind = meta.kind if meta is not None else model_kind(args, set(first) | set(last_names))
    emb = first.get("language_model.embedding.word_embeddings.weight")
    if emb is None:
        raise UserError(f"{source}: the first stage has no word embeddings")
    padded = emb.shape[0] * tp
    size, how = true_vocab_size(args, padded, tp=tp, vocab=vocab, source=source)
    layers = sum(map(sum, counts))
    if meta is not None:
        cfg = dataclasses.replace(meta.model, vocab_size=size)
    else:
        cfg = upstream_model_config(
            args, first, kind=kind, tp=tp, vocab_size=size, num_layers=layers, source=source
        )
    if cfg.num_layers != layers:
        raise UserError(f"{source}: args say {cfg.num_layers} layers, the shards hold {layers}")
    binary = any(n.startswith("binary_head.") for n in last_names)
    fresh = meta.fresh_heads if meta is not None else ()
    return ModelSpec(kind=kind, cfg=cfg, add_binary_head=binary, fresh_heads=fresh), padded, how, meta


def _index(
    spec: ModelSpec,
    locals_: dict[tuple[int, int, int], dict[str, str]],
    file_index: dict[tuple[int, int], int],
    chunk_keys: list[str],
    counts: list[list[int]],
    tp: int,
    files: list[Path],
    keep: Callable[[str], bool],
    etp: int | None = None,
) -> tuple[dict[str, _Entry], dict[str, _Entry], list[Slot]]:
    """Entries of the tensors read (``keep(local name)``), the head copies, and the slots left
    unread (experts of other EP ranks: counted in the parameters, never read)."""
    pp, vp = len(counts), len(counts[0])
    layers = layers_from_counts(counts)
    entries: dict[str, _Entry] = {}
    heads: dict[str, _Entry] = {}
    unread: list[Slot] = []
    for s in range(pp):
        for c in range(vp):
            pre, post = s == 0 and c == 0, s == pp - 1 and c == vp - 1
            every = chunk_slots(
                spec, tp=tp, pre_process=pre, post_process=post, layer_numbers=layers[s][c], etp=etp
            )
            slots = [slot for slot in every if keep(slot.local)]
            unread += [slot for slot in every if not keep(slot.local)]
            expected = {slot.local for slot in slots}
            for t in range(tp):
                have, path = locals_[(t, s, c)], files[file_index[(t, s)]]
                missing = sorted(expected - set(have))
                extra = sorted(set(have) - expected - {"word_embeddings_for_head.weight"})
                if missing or extra:
                    what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
                    raise UserError(f"{path}: {chunk_keys[c]} does not match a {spec.kind} chunk ({what})")
            for slot in slots:
                refs = [
                    (file_index[(t, s)], chunk_keys[c], locals_[(t, s, c)][slot.local]) for t in range(tp)
                ]
                target = heads if slot.local.startswith("word_embeddings_for_head.") else entries
                target[slot.canonical] = _Entry(slot, refs)
            if pre and post and "word_embeddings_for_head.weight" in locals_[(0, s, c)]:
                emb = next(x for x in slots if x.local == "language_model.embedding.word_embeddings.weight")
                head_key = "word_embeddings_for_head.weight"
                refs = [(file_index[(t, s)], chunk_keys[c], locals_[(t, s, c)][head_key]) for t in range(tp)]
                heads[emb.canonical] = _Entry(emb, refs)
    return entries, heads, unread


def _num_params(spec: ModelSpec, entries: dict[str, _Entry], tp: int, unread: list[Slot]) -> int:
    total = 0
    for e in [*entries.values(), *(_Entry(slot, []) for slot in unread)]:
        shape = list(e.slot.shape)
        if e.slot.dim is not None:
            shape[e.slot.dim] *= e.slot.shards or tp
        lay = e.slot.layout
        if e.slot.dim == 0 and lay is not None and lay.groups is not None:  # K/V replicated when tp > groups
            shape[0] = (lay.groups * lay.q_per_group + 2 * lay.groups) * lay.head_dim
        if e.slot.vocab:
            shape[0] = spec.cfg.vocab_size
        total += int(torch.Size(shape).numel())
    return total


def _same_chunk_keys(files: list[Path], states: list[dict[str, Any]]) -> list[str]:
    """The model chunk keys (``model`` or ``model0..``) every rank file holds, the same in each."""
    chunk_keys = _chunk_keys(states[0], files[0])
    for f, st in zip(files, states, strict=True):
        if _chunk_keys(st, f) != chunk_keys:
            raise UserError(f"{f}: holds chunks {_chunk_keys(st, f)}, {files[0]} holds {chunk_keys}")
    return chunk_keys


def open_legacy(
    it_dir: Path,
    iteration: int | str | None,
    *,
    vocab: VocabOptions | None = None,
    root: Path | None = None,
    experts: ExpertShare | None = None,
) -> LegacyReader:
    """Open a legacy-format iteration directory (all rank files mmap'd, nothing materialised).

    ``experts``: read only that share's routed experts, from the files of the EP ranks holding
    them (their dense tensors from the first of those); the first rank file gives only ``args``."""
    first_dir = first_rank_dir(it_dir)
    first_state = load_untrusted(first_dir / MODEL_FILE)
    args0 = dict(as_mapping(first_state.get("args")))
    tp, pp, ep, dirs = _rank_grid(it_dir, args0)
    num_experts = int(args0.get("num_experts") or 0)
    file_eps = experts.file_ranks(num_experts, ep) if experts is not None and num_experts else list(range(ep))
    files = [dirs[(t, p, file_eps[0])] / MODEL_FILE for p in range(pp) for t in range(tp)]
    file_index = {(t, p): p * tp + t for p in range(pp) for t in range(tp)}
    states = [first_state if f.parent == first_dir else load_untrusted(f) for f in files]
    chunk_keys = _same_chunk_keys(files, states)
    vp = len(chunk_keys)
    flats = [{ck: flatten(st[ck]) for ck in chunk_keys} for st in states]
    expert_files: list[Path] = []
    if args0.get("num_experts"):  # per-EP-rank files merged, expert indices made global
        flats, expert_files = merge_expert_ranks(
            flats, states, dirs, args0, tp=tp, pp=pp, ep=ep, chunk_keys=chunk_keys, chunk_keys_of=_chunk_keys,
            ep_ranks=file_eps,
        )  # fmt: skip

    def keep(name: str) -> bool:
        return experts is None or experts.keeps(name, num_experts)

    locals_ = {
        (t, p, c): {n: k for n, k in _local_names(flats[file_index[(t, p)]][ck]).items() if keep(n)}
        for (t, p) in {k[:2] for k in dirs}
        for c, ck in enumerate(chunk_keys)
    }
    counts = [[_layer_count(locals_[(0, p, c)]) for c in range(vp)] for p in range(pp)]
    source = str(it_dir)
    spec, padded, how, meta = _model_spec(
        states, flats[0][chunk_keys[0]], locals_, counts, tp, vocab=vocab or VocabOptions(), source=source
    )
    if spec.cfg.untie_embeddings_and_output_weights:  # mcore output_layer / legacy head copy
        locals_ = {k: untie_head_names(v) for k, v in locals_.items()}
    if spec.cfg.num_experts is not None:
        check_expert_files(spec, locals_, dirs, counts, tp=tp, ep=ep, keep=keep)
    etp = expert_tp_of(args0, tp=tp, where=str(it_dir)) if spec.cfg.num_experts is not None else None
    entries, heads, unread = _index(spec, locals_, file_index, chunk_keys, counts, tp, files, keep, etp)
    dtypes = sorted(
        {str(t.dtype).removeprefix("torch.") for flat in flats for t in flat[chunk_keys[0]].values()}
    )
    info = CheckpointInfo(
        path=source, format="torch", iteration=states[0].get("iteration", iteration),
        checkpoint_version=float(states[0].get("checkpoint_version", 0) or 0), kind=spec.kind, tp=tp, pp=pp,
        vp=vp, ep=ep, vocab_size=spec.cfg.vocab_size, vocab_source=how, padded_vocab_size=padded,
        num_parameters=_num_params(spec, entries, tp, unread), dtypes=tuple(dtypes), ours=meta is not None,
        root=str(root or ""), vocab_known=not how.startswith("padded"),
    )  # fmt: skip
    return LegacyReader(
        spec=spec, info=info, files=files, states=states, flats=flats, entries=entries, head_copies=heads,
        pages=PageReleaser([*files, *expert_files]), metadata=meta,
        norm_1p=meta is None and layernorm_1p(as_mapping(states[0].get("args"))),
    )  # fmt: skip
