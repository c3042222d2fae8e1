"""GPT pretraining samples from indexed datasets: splits, epochs, shuffling, blending, on-disk index maps.

How samples are made (Megatron's construction, numpy-vectorised):

1. **Split.** The documents of each dataset are cut into contiguous train/valid/test ranges by the
   ratios of ``split`` (``"969,30,1"``), with Megatron's rounding.
2. **Epochs.** Enough epochs ``E`` are taken that ``E * tokens_per_epoch >= num_samples * seq_length
   + 1``. The document order is a fresh permutation every epoch (``document_index``, ``E * D``
   entries) drawn from ``numpy.random.RandomState(seed)``.
3. **Samples.** The shuffled documents form one token stream; sample ``j`` is the ``seq_length + 1``
   tokens starting at stream position ``j * seq_length`` (consecutive samples share one token, so
   every token is a target exactly once). ``sample_index[j] = (position in document_index, offset
   in that document)``; samples cross document boundaries freely.
4. **Shuffle.** ``shuffle_index`` permutes the samples. When the last epoch is needed for fewer
   than 80% of its samples, it is shuffled separately and placed after the others (as Megatron),
   so the first ``E - 1`` epochs are seen in full before any of the partial last one.

Sample ``i`` is ``sample_index`` entry ``shuffle_index[i]``: a dict of torch tensors
``tokens`` int64 [s], ``labels`` int64 [s] (tokens shifted by one), ``loss_mask`` float32 [s]
(0 where the *input* token is eod if ``eod_mask_loss``) and ``position_ids`` int64 [s]. Nothing
depends on the data-parallel size: :func:`global_batch_indices` cuts the global sample order into
contiguous per-rank slices.

The three index arrays are cached as ``.npy`` in ``cache_dir`` (Megatron's ``--data-cache-path``)
under a hash of everything they depend on: the content of the ``.idx`` file, the split's documents,
``seq_length``, ``seed``, ``num_samples``. Changing any input changes the hash, so stale maps are
never used. Files are written atomically (temporary + rename, the description file last); ranks
that build the same maps concurrently write identical bytes. ``cache_dir=None`` keeps them in memory.

Blending (``data_prefix = ("0.3", "a", "0.7", "b")``, as ``--data-path``) uses Megatron's greedy
rule: sample ``i`` comes from the dataset whose share so far lags its weight the most.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pretrain.data.blending import BLEND_MARGIN, BlendedDataset, build_blending_indices
from pretrain.data.index_cache import MAPS_VERSION, IndexCache, data_hash, file_digest
from pretrain.data.indexed_dataset import IndexedDataset, index_file_path
from pretrain.data.sample_index import (
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    epochs_needed,
)
from pretrain.utils.errors import UserError

SPLIT_NAMES = ("train", "valid", "test")
__all__ = [
    "BlendedDataset",
    "GPTDataset",
    "GPTDatasetConfig",
    "build_blending_indices",
    "build_gpt_datasets",
    "collate_samples",
    "data_hash",
    "global_batch_indices",
    "parse_data_prefix",
    "parse_split",
    "split_document_ranges",
]


# --------------------------------------------------------------------------------------------- config


def parse_split(split: str) -> tuple[float, float, float]:
    """``"969,30,1"`` (or ``"969/30/1"``) -> normalised (train, valid, test) fractions."""
    text = str(split).replace("/", ",")
    try:
        parts = [float(p) for p in text.split(",") if p.strip() != ""]
    except ValueError:
        raise UserError(f"--split {split!r}: expected up to three numbers like 969,30,1") from None
    if not parts or len(parts) > 3 or any(p < 0 or not math.isfinite(p) for p in parts) or sum(parts) <= 0:
        raise UserError(f"--split {split!r}: expected up to three non-negative numbers with a positive sum")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return (parts[0] / total, parts[1] / total, parts[2] / total)


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` document ranges of train/valid/test (Megatron's rounding: each
    split size is rounded, and the rounding surplus is taken from the train split)."""
    fractions = parse_split(split)
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    bounds = [min(max(b, 0), num_documents) for b in bounds]
    for i in range(1, len(bounds)):
        bounds[i] = max(bounds[i], bounds[i - 1])
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def parse_data_prefix(data_prefix: Sequence[str | float]) -> list[tuple[str, float | None]]:
    """Megatron's ``--data-path``: ``[p1, p2, ...]`` or ``[w1, p1, w2, p2, ...]`` -> [(prefix, weight)]."""
    items = [str(x) for x in data_prefix]
    if not items:
        raise UserError("--data-path: no dataset given")
    if len(items) == 1:
        return [(items[0], None)]
    try:
        weights = [float(w) for w in items[0::2]]
    except ValueError:
        return [(p, None) for p in items]
    if len(items) % 2:
        raise UserError(f"--data-path: weights and prefixes must alternate (got {len(items)} items)")
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise UserError(f"--data-path: weights must be non-negative with a positive sum, got {weights}")
    return [(p, w) for w, p in zip(weights, items[1::2], strict=True)]


@dataclass(frozen=True, kw_only=True)
class GPTDatasetConfig:
    """Everything GPT samples depend on (the cache key uses all but ``eod_*`` and ``cache_dir``)."""

    seq_length: int
    data_prefix: tuple[str, ...]  # --data-path: prefixes, optionally "weight prefix" pairs
    seed: int = 1234
    split: str = "969,30,1"
    cache_dir: str | None = None  # --data-cache-path; None keeps index maps in memory only
    eod_mask_loss: bool = False
    eod_id: int | None = None
    blend: tuple[tuple[str, float | None], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.data_prefix, (str, os.PathLike)):
            object.__setattr__(self, "data_prefix", (os.fspath(self.data_prefix),))
        object.__setattr__(
            self,
            "data_prefix",
            tuple(os.fspath(p) if isinstance(p, os.PathLike) else str(p) for p in self.data_prefix),
        )
        if int(self.seq_length) <= 0:
            raise UserError(f"--seq-length must be positive, got {self.seq_length}")
        parse_split(self.split)
        object.__setattr__(self, "blend", tuple(parse_data_prefix(self.data_prefix)))
        if self.eod_mask_loss and self.eod_id is None:
            raise UserError("--eod-mask-loss needs a tokenizer with an end-of-document token")
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))


# --------------------------------------------------------------------------------------------- datasets


class GPTDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """GPT samples of ``seq_length + 1`` tokens from one split of one indexed dataset.

    ``documents`` are the document ids of the split (default: all). ``len(ds)`` counts every sample
    of the epochs built (at least ``num_samples``; one epoch if ``num_samples`` is None).
    """

    def __init__(
        self,
        indexed: IndexedDataset | str,
        config: GPTDatasetConfig,
        *,
        documents: np.ndarray | None = None,
        num_samples: int | None = None,
        split: str = "train",
    ) -> None:
        self.indexed = indexed if isinstance(indexed, IndexedDataset) else IndexedDataset(indexed)
        self.config = config
        self.split = split
        self.seq_length = int(config.seq_length)
        docs = (
            np.arange(self.indexed.num_documents, dtype=np.int64)
            if documents is None
            else np.asarray(documents)
        )
        self.documents = docs.astype(np.int64)
        self.num_samples = num_samples
        self._doc_lengths = self.indexed.document_lengths
        self._doc_offsets = self.indexed.document_offsets
        self.tokens_per_epoch = int(self._doc_lengths[self.documents].sum()) if self.documents.size else 0
        if self.tokens_per_epoch == 0 or (num_samples is None and self.tokens_per_epoch <= self.seq_length):
            raise UserError(
                f"{index_file_path(self.indexed.prefix)}: the {split} split has {self.documents.size} "
                f"documents and {self.tokens_per_epoch} tokens, too few for samples of "
                f"{self.seq_length + 1} tokens"
            )
        if self.documents.size and (
            self.documents.min() < 0 or self.documents.max() >= self.indexed.num_documents
        ):
            raise ValueError(f"document ids out of range for {self.indexed.num_documents} documents")
        desc = {
            "class": "GPTDataset",
            "version": MAPS_VERSION,
            "index_file_digest": file_digest(index_file_path(self.indexed.prefix)),
            "split": split,
            "documents": self._documents_key(),
            "seq_length": self.seq_length,
            "seed": int(config.seed),
            "num_samples": None if num_samples is None else int(num_samples),
        }
        cache = IndexCache(
            config.cache_dir, "GPTDataset", split, desc, ("document_index", "sample_index", "shuffle_index")
        )
        self.unique_description_hash = cache.unique
        loaded = cache.load()
        self.cache_hit = loaded is not None
        if loaded is None:
            loaded = self._build_maps()
            cache.save(loaded)
        self.cache_paths = dict(cache.paths)
        self.document_index = loaded["document_index"]
        self.sample_index = loaded["sample_index"]
        self.shuffle_index = loaded["shuffle_index"]

    def _documents_key(self) -> Any:
        d = self.documents
        if d.size and np.array_equal(d, np.arange(int(d[0]), int(d[0]) + d.size)):
            return {"range": [int(d[0]), int(d[0]) + int(d.size)]}
        return {
            "digest": hashlib.md5(d.astype("<i8").tobytes(), usedforsecurity=False).hexdigest(),
            "n": int(d.size),
        }

    def _build_maps(self) -> dict[str, np.ndarray]:
        s, T, n = self.seq_length, self.tokens_per_epoch, self.num_samples
        num_epochs = epochs_needed(T, s, n)
        separate_last_epoch = False
        if n is not None and num_epochs > 1:
            sans_last = ((num_epochs - 1) * T - 1) // s
            from_last = n - sans_last
            per_epoch = (T - 1) // s
            separate_last_epoch = from_last < int(0.80 * per_epoch)
        rng = np.random.RandomState(int(self.config.seed) % 2**32)
        document_index = build_document_index(self.documents, num_epochs, rng)
        sample_index = build_sample_index(self._doc_lengths, document_index, s)
        total = sample_index.shape[0] - 1
        first = ((num_epochs - 1) * T - 1) // s if separate_last_epoch else total
        shuffle_index = build_shuffle_index(first, total, rng)
        return {
            "document_index": document_index,
            "sample_index": sample_index,
            "shuffle_index": shuffle_index,
        }

    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def sample_tokens(self, j: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of *unshuffled* sample ``j`` (int64)."""
        k0, o0 = (int(x) for x in self.sample_index[j])
        k1, o1 = (int(x) for x in self.sample_index[j + 1])
        read = self.indexed.read
        if k0 == k1:
            doc = int(self.document_index[k0])
            out = np.array(read(int(self._doc_offsets[doc]) + o0, o1 - o0 + 1), dtype=np.int64)  # a copy
        else:
            parts = []
            doc = int(self.document_index[k0])
            parts.append(read(int(self._doc_offsets[doc]) + o0, int(self._doc_lengths[doc]) - o0))
            for k in range(k0 + 1, k1):
                doc = int(self.document_index[k])
                parts.append(read(int(self._doc_offsets[doc]), int(self._doc_lengths[doc])))
            doc = int(self.document_index[k1])
            parts.append(read(int(self._doc_offsets[doc]), o1 + 1))
            out = np.concatenate(parts).astype(np.int64)
        if out.size != self.seq_length + 1:  # pragma: no cover - guards the index construction
            raise RuntimeError(f"sample {j} has {out.size} tokens, expected {self.seq_length + 1}")
        return out

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        i = int(idx)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples ({self.split})")
        return make_sample(self.sample_tokens(int(self.shuffle_index[i])), self.config)

    def __repr__(self) -> str:
        return (
            f"GPTDataset({self.indexed.prefix!r}, split={self.split}, documents={self.documents.size}, "
            f"samples={len(self)}, seq_length={self.seq_length})"
        )


def make_sample(tokens: np.ndarray, config: GPTDatasetConfig) -> dict[str, torch.Tensor]:
    """``seq_length + 1`` tokens -> the sample dict (inputs, shifted labels, loss mask, positions)."""
    t = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
    inputs, labels = t[:-1].clone(), t[1:].clone()
    loss_mask = torch.ones(inputs.shape[0], dtype=torch.float32)
    if config.eod_mask_loss and config.eod_id is not None:
        loss_mask[inputs == int(config.eod_id)] = 0.0
    position_ids = torch.arange(inputs.shape[0], dtype=torch.int64)
    return {"tokens": inputs, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


def collate_samples(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack sample dicts into a batch dict ([b, s] tensors)."""
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


# --------------------------------------------------------------------------------------------- building


def build_gpt_datasets(
    config: GPTDatasetConfig, train_valid_test_num_samples: Sequence[int | None]
) -> tuple[
    GPTDataset | BlendedDataset | None, GPTDataset | BlendedDataset | None, GPTDataset | BlendedDataset | None
]:
    """Train, valid and test datasets; ``None`` where 0 samples are asked or where a valid/test split
    has no documents (as Megatron; ``"969,30,1"`` of 300 documents leaves test empty). An empty
    train split with samples requested is a :class:`UserError`.

    ``train_valid_test_num_samples``: samples each split must supply (``None``: one epoch). With
    several prefixes, each dataset supplies ``ceil(weight * n * 1.005)`` samples (Megatron's
    margin); without weights, datasets are weighted by their tokens in the split.
    """
    if len(train_valid_test_num_samples) != 3:
        raise ValueError("train_valid_test_num_samples needs three entries")
    indexed = {p: IndexedDataset(p) for p, _ in config.blend}
    out = [
        None if n is not None and int(n) <= 0 else _split_dataset(config, indexed, s, n)
        for s, n in enumerate(train_valid_test_num_samples)
    ]
    return out[0], out[1], out[2]


_Part = tuple[str, "float | None", np.ndarray]  # (prefix, weight, document ids of the split)


def _split_dataset(config: GPTDatasetConfig, indexed: dict[str, IndexedDataset], s: int,
                   n: int | None) -> GPTDataset | BlendedDataset | None:  # fmt: skip
    """The dataset of split ``s`` (see :func:`build_gpt_datasets`)."""
    name = SPLIT_NAMES[s]
    parts: list[_Part] = []
    for prefix, weight in config.blend:
        if weight != 0:
            lo, hi = split_document_ranges(config.split, indexed[prefix].num_documents)[s]
            parts.append((prefix, weight, np.arange(lo, hi, dtype=np.int64)))
    if all(docs.size == 0 for _, _, docs in parts):
        if name != "train" or n is None:
            return None  # as Megatron: no documents, no dataset (e.g. no test set)
        raise UserError(
            f"--split {config.split}: the {name} split of {', '.join(p for p, _, _ in parts)} has no "
            f"documents, but {n} {name} samples are needed"
        )
    if len(parts) == 1:
        prefix, _, docs = parts[0]
        return GPTDataset(indexed[prefix], config, documents=docs, num_samples=n, split=name)
    return _blend(config, indexed, parts, name, n)


def _blend(config: GPTDatasetConfig, indexed: dict[str, IndexedDataset], parts: list[_Part], name: str,
           n: int | None) -> BlendedDataset:  # fmt: skip
    """Several datasets' share of one split, blended by weight (by tokens when unweighted)."""
    empty = [p for p, _, docs in parts if docs.size == 0]
    if empty:
        raise UserError(f"--split {config.split}: the {name} split of {empty[0]} has no documents")
    if parts[0][1] is None:
        weights = [float(indexed[p].document_lengths[docs].sum()) for p, _, docs in parts]
    else:
        weights = [float(w or 0.0) for _, w, _ in parts]
    total = sum(weights)
    weights = [w / total for w in weights]
    if n is None:
        components = [
            GPTDataset(indexed[p], config, documents=docs, num_samples=None, split=name)
            for p, _, docs in parts
        ]
        size = sum(len(c) for c in components)
    else:
        size = int(n)
        components = [
            GPTDataset(
                indexed[p], config, documents=docs, num_samples=math.ceil(w * size * BLEND_MARGIN), split=name
            )  # fmt: skip
            for (p, _, docs), w in zip(parts, weights, strict=True)
        ]
    return BlendedDataset(components, weights, size, config.cache_dir, split=name)


def global_batch_indices(iteration: int, global_batch: int, dp_rank: int, dp_size: int) -> np.ndarray:
    """Sample indices (into the dataset's global order) that data-parallel rank ``dp_rank`` uses in
    ``iteration`` (0-based): the global batch ``[iteration * global_batch, (iteration + 1) *
    global_batch)`` cut into ``dp_size`` contiguous slices. Which samples make up a global batch
    does not depend on ``dp_size``."""
    if dp_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
    if global_batch <= 0 or global_batch % dp_size:
        raise ValueError(f"global batch {global_batch} is not divisible by the data-parallel size {dp_size}")
    per_rank = global_batch // dp_size
    start = iteration * global_batch + dp_rank * per_rank
    return np.arange(start, start + per_rank, dtype=np.int64)
