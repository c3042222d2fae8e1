"""The shared checkpoint types: what every reader, writer and command passes between layers.

* :class:`CheckpointMetadata` -- the typed record every checkpoint we write carries (nested as
  plain data inside the Megatron-named ``args`` Namespace, see :mod:`pretrain.checkpoint.metadata`):
  model kind and architecture (the whole :class:`~pretrain.config.ModelConfig`), parallel layout,
  the tokenizer (:class:`TokenizerRecord`) and provenance (:class:`Provenance`).
* :class:`CheckpointInfo` -- what a reader tells about a checkpoint on disk (``mlm-convert inspect``).
* :class:`TensorSource` -- the one protocol of anything that yields canonical full tensors (every
  reader, the streamed Hugging Face source); :class:`CheckpointReader` adds what an opened Megatron
  checkpoint tells (``info``, ``metadata``, ``args``). :class:`DictSource` holds tensors in memory,
  :class:`LazySource` makes each on demand (e.g. converted from Hugging Face).

This module imports nothing from the readers or writers, so every one of them can import it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, Self, runtime_checkable

import numpy as np
import torch

from pretrain.checkpoint.plan import ModelSpec
from pretrain.config import ModelConfig
from pretrain.models.kinds import kind_of
from pretrain.models.sharding import is_vocab_tensor
from pretrain.parallel.config import ParallelConfig
from pretrain.tokenizer.record import TokenizerRecord
from pretrain.utils.errors import UserError

METADATA_SCHEMA = "mlm-toolkit/checkpoint/v2"


@dataclass(frozen=True, kw_only=True)
class Provenance:
    """Where the weights came from: training progress, data, sources of conversions."""

    iteration: int | str | None = None
    consumed_samples: int | None = None
    global_batch_size: int | None = None  # consumed samples = iteration x this (no batch ramp-up)
    data_hash: str | None = None
    weights_fingerprint: str | None = None
    converted_from: str | None = None
    source_model_type: str | None = None  # a Hugging Face model_type converted from (to-hf writes it back)
    resharded_from: str | None = None
    argv: tuple[str, ...] = ()
    toolkit_version: str | None = None


@dataclass(frozen=True, kw_only=True)
class FinetuneRecord:
    """What ``mlm-finetune --save`` trained: the task, its head's description, the start model."""

    task: str
    head: dict[str, int | float | str | bool | None] = field(default_factory=dict)
    source: str | None = None
    # the weights fingerprint of ``source`` (the pretrained trunk): the leaderboard row of every
    # result of this finetuning, --eval-only's included
    source_fingerprint: str | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointMetadata:
    """The typed record of one checkpoint (see the module docstring)."""

    kind: str  # "gpt" or "bert"
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    tokenizer: TokenizerRecord | None = None
    provenance: Provenance = Provenance()
    add_binary_head: bool = False
    fresh_heads: tuple[str, ...] = ()
    finetune: FinetuneRecord | None = None
    module_names: str = "mcore"  # "mcore" or "legacy": the names of the model's tensors in the files

    def __post_init__(self) -> None:
        kind_of(self.kind, where="checkpoint metadata")

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(
            kind=self.kind, cfg=self.model, add_binary_head=self.add_binary_head, fresh_heads=self.fresh_heads
        )


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """What ``mlm-convert inspect`` reports about a checkpoint."""

    path: str
    format: str  # "torch" (legacy) or "torch_dist"
    iteration: int | str | None
    checkpoint_version: float
    kind: str
    tp: int
    pp: int
    vp: int
    vocab_size: int
    vocab_source: str
    padded_vocab_size: int
    num_parameters: int
    dtypes: tuple[str, ...]
    ours: bool  # written by mlm-toolkit
    root: str = ""  # the checkpoint root (holds the tracker and tokenizer/); "" if unknown
    vocab_known: bool = True  # False: the true vocabulary size is unknown (padded rows counted)
    ep: int = 1  # expert-parallel ranks of the files (legacy format: one file per TP x PP x EP rank)


@dataclass(frozen=True)
class RowPieces:
    """A tensor as contiguous row blocks, in order: ``parts`` (each ``[r_i, ...]``, one dtype)
    joined along dim 0 are the tensor. A reader gives the weights fingerprint these instead of
    joining them (no copy, no fresh pages): :meth:`LegacyReader.row_pieces
    <pretrain.checkpoint.legacy.reader.LegacyReader.row_pieces>`."""

    parts: tuple[torch.Tensor, ...]
    release: Callable[[], None] | None = None  # called once they are read (a reader's page release)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), *self.parts[0].shape[1:]))

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def __getitem__(self, rows: slice) -> RowPieces:
        """The first ``rows.stop`` rows (``pieces[:n]``, as a vocabulary tensor is cut)."""
        if rows.start not in (None, 0) or rows.step not in (None, 1) or rows.stop is None:
            raise ValueError(f"RowPieces takes only a leading row count, not {rows}")
        kept, left = [], rows.stop
        for part in self.parts:
            if left <= 0:
                break
            kept.append(part[:left])
            left -= part.shape[0]
        return RowPieces(tuple(kept), self.release)

    def padded(self, rows: int) -> RowPieces:
        """The first ``rows`` rows, with zero rows after the last piece where there are fewer (a
        vocabulary tensor padded for a target layout: only the zero rows are new memory)."""
        have = self.shape[0]
        if have >= rows:
            return self[:rows]
        zeros = torch.zeros((rows - have, *self.shape[1:]), dtype=self.dtype)
        return RowPieces((*self.parts, zeros), self.release)

    def take(self, index: np.ndarray) -> RowPieces:
        """Rows ``index`` (int64 ``[n]``, in that order) as contiguous row slices of the parts,
        consecutive rows of one part joined into one slice (no copy; no release: the caller
        releases these pieces). In NumPy: one pass, not a Python step per row."""
        sizes = np.array([p.shape[0] for p in self.parts])
        starts = np.cumsum(sizes) - sizes
        if index.size and (index.min() < 0 or index.max() >= sizes.sum()):
            raise IndexError(f"rows outside the {int(sizes.sum())} rows of the pieces")
        piece = np.searchsorted(starts, index, side="right") - 1
        breaks = np.flatnonzero((index[1:] != index[:-1] + 1) | (piece[1:] != piece[:-1])) + 1
        bounds = [0, *breaks.tolist(), index.size]
        slices = []
        for lo, hi in itertools.pairwise(bounds):
            if hi > lo:
                k = int(piece[lo])
                first = int(index[lo] - starts[k])
                slices.append(self.parts[k][first : first + (hi - lo)])
        if not slices:  # no rows: an empty slice keeps the dtype and row shape
            slices.append(self.parts[0][:0])
        return RowPieces(tuple(slices))


@dataclass(frozen=True)
class ColumnPieces:
    """A 2-D tensor as contiguous column blocks, in order: ``parts`` (each ``[R, c_i]``, one dtype)
    joined along dim 1 are the tensor (a row-parallel tensor's TP shards as stored). Its bytes in
    row-major order are, for each row, that row of each part in turn: a writer gathers them from
    where they lie instead of joining a copy (:meth:`LegacyReader.column_pieces
    <pretrain.checkpoint.legacy.reader.LegacyReader.column_pieces>`)."""

    parts: tuple[torch.Tensor, ...]
    release: Callable[[], None] | None = None  # called once they are written (a reader's page release)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.parts[0].shape[0], sum(p.shape[1] for p in self.parts)))

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype


@runtime_checkable
class TensorSource(Protocol):
    """Canonical full tensors by name: a checkpoint reader (legacy ``torch``, ``torch_dist``), a
    Hugging Face directory streamed (:class:`LazySource`) or tensors in memory (:class:`DictSource`).

    ``tensor(name)`` has the true vocabulary's rows; ``stored_rows(name)`` every row the source
    keeps (a Megatron checkpoint's vocabulary padding included; the same as ``tensor`` elsewhere).
    ``with_vocab(n)`` is a view with another true vocabulary size (``source`` says who told it),
    checked against what the source records: a source is never reopened to learn it.
    """

    @property
    def spec(self) -> ModelSpec: ...

    def names(self) -> list[str]: ...

    def tensor(self, name: str) -> torch.Tensor: ...

    def stored_rows(self, name: str) -> torch.Tensor: ...

    def with_vocab(self, vocab_size: int, *, source: str = "") -> Self: ...


@runtime_checkable
class RowPieceSource(Protocol):
    """A source that can give a tensor as its stored row blocks (:class:`RowPieces`) instead of
    joining them: ``row_pieces(name)`` is None where the tensor is not stored that way.
    ``stored=True``: a vocabulary tensor with every row it stores (``stored_rows``: the padding
    rows after the true vocabulary), not cut to the true vocabulary."""

    def row_pieces(self, name: str, *, stored: bool = False) -> RowPieces | None: ...


@runtime_checkable
class ColumnPieceSource(Protocol):
    """A source that can give a 2-D tensor as its stored column blocks (:class:`ColumnPieces`):
    ``column_pieces(name)`` is None where the tensor is not stored that way."""

    def column_pieces(self, name: str) -> ColumnPieces | None: ...


class CheckpointReader(TensorSource, Protocol):
    """An opened Megatron checkpoint (any format): its tensors, what it is, and what it records."""

    @property
    def info(self) -> CheckpointInfo: ...

    @property
    def metadata(self) -> CheckpointMetadata | None: ...  # our record; None for upstream checkpoints

    @property
    def args(self) -> Mapping[str, object]: ...  # the Megatron-named args (names the tokenizer)


def _spec_with_vocab(spec: ModelSpec, vocab_size: int) -> ModelSpec:
    return dataclasses.replace(spec, cfg=dataclasses.replace(spec.cfg, vocab_size=vocab_size))


def _check_rows(rows: int, vocab_size: int, source: str) -> None:
    if not 0 < vocab_size <= rows:
        raise UserError(
            f"{source or 'the vocabulary size'}: {vocab_size} tokens, but the source has {rows} rows"
        )


@dataclass
class DictSource:
    """Canonical full tensors held in memory (e.g. converted from Hugging Face)."""

    spec: ModelSpec
    full: dict[str, torch.Tensor]

    def names(self) -> list[str]:
        return list(self.full)

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.full:
            raise UserError(f"source has no tensor {name!r}")
        return self.full[name]

    def stored_rows(self, name: str) -> torch.Tensor:
        return self.tensor(name)

    def with_vocab(self, vocab_size: int, *, source: str = "") -> DictSource:
        """The first ``vocab_size`` rows of every vocabulary tensor."""
        full = {}
        for name, t in self.full.items():
            if is_vocab_tensor(name):
                _check_rows(t.shape[0], vocab_size, source)
                t = t[:vocab_size]
            full[name] = t
        return DictSource(spec=_spec_with_vocab(self.spec, vocab_size), full=full)


@dataclass
class LazySource:
    """Canonical full tensors made on demand (e.g. from memory-mapped Hugging Face files).

    ``makers[name]()`` builds one full tensor; nothing is kept, so a writer that asks for one
    tensor at a time holds one. ``after`` (optional) runs after each tensor is made: it gives back
    the resident pages of the mapped input files (see :class:`~pretrain.checkpoint.legacy.pages.PageReleaser`)."""

    spec: ModelSpec
    makers: dict[str, Callable[[], torch.Tensor]]
    after: Callable[[], None] | None = None
    # each tensor's dtype and shape once known (pretrain.checkpoint.tensor_meta), as a meta tensor
    meta_cache: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    # per name (optional): the row blocks, as views of the input, whose join is makers[name]()
    row_parts: dict[str, Callable[[], tuple[torch.Tensor, ...]]] = field(default_factory=dict)
    vocab_cut: tuple[int, str] | None = None  # with_vocab's cut of the vocabulary tensors (size, source)

    def names(self) -> list[str]:
        return list(self.makers)

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.makers:
            raise UserError(f"source has no tensor {name!r}")
        t = self.makers[name]()
        if self.after is not None:
            self.after()
        return t

    def stored_rows(self, name: str) -> torch.Tensor:
        return self.tensor(name)

    def row_pieces(self, name: str, *, stored: bool = False) -> RowPieces | None:
        """:meth:`tensor` as the input's row blocks it joins, where the family gives them (see
        :class:`~pretrain.models.families.converter.HFImport`): written and hashed where they lie.
        ``after`` runs once they are read (:attr:`RowPieces.release`). None elsewhere. (``stored``:
        the same rows, as :meth:`stored_rows` is :meth:`tensor` here.)"""
        make = self.row_parts.get(name)
        if make is None:
            return None
        parts = make()
        if not parts or not all(p.is_contiguous() and p.device.type == "cpu" for p in parts):
            return None
        pieces = RowPieces(parts, self.after)
        if self.vocab_cut is not None and is_vocab_tensor(name):
            vocab_size, source = self.vocab_cut
            _check_rows(pieces.shape[0], vocab_size, source)
            return pieces[:vocab_size]
        return pieces

    def column_pieces(self, name: str) -> ColumnPieces | None:
        """A 2-D tensor that is one input tensor as it lies (``o_proj``, ``down_proj``) as one column
        block, so that a writer takes a column range of it as a view; None elsewhere."""
        pieces = self.row_pieces(name)
        if pieces is None or len(pieces.parts) != 1 or pieces.parts[0].dim() != 2:
            return None
        return ColumnPieces(pieces.parts, pieces.release)

    def with_vocab(self, vocab_size: int, *, source: str = "") -> LazySource:
        """Every vocabulary tensor cut to its first ``vocab_size`` rows when made."""

        def cut(make: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
            def made() -> torch.Tensor:
                t = make()
                _check_rows(t.shape[0], vocab_size, source)
                return t[:vocab_size]

            return made

        makers = {n: cut(m) if is_vocab_tensor(n) else m for n, m in self.makers.items()}
        return LazySource(_spec_with_vocab(self.spec, vocab_size), makers, after=self.after,
                          row_parts=self.row_parts, vocab_cut=(vocab_size, source))  # fmt: skip


class SourceTensors(Mapping[str, torch.Tensor]):
    """``names`` of a :class:`TensorSource` as a read-only mapping whose tensors are read from the
    source on each access (no copy of the weights is held: a caller that keeps it for a whole run
    holds nothing beside the model's parameters)."""

    def __init__(self, reader: TensorSource, names: list[str]) -> None:
        self._reader, self._names, self._set = reader, list(names), set(names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._set:
            raise KeyError(name)
        return self._reader.tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self._set

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
