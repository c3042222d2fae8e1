"""BERT pretraining samples from an indexed dataset of sentences grouped into documents.

Each sequence of the indexed dataset is one sentence (``mlm-preprocess --split-sentences``).

1. **Sample map** (Megatron's ``build_mapping``): documents are walked in order, epoch after
   epoch, until ``num_samples`` samples exist (one epoch when None). Documents with fewer than
   ``min_sentences`` sentences (2 with the sentence-order head, else 1), and documents of several
   sentences one of which is longer than 512 tokens, are skipped. Consecutive sentences are
   gathered into a sample until their tokens reach a target length, provided the sample has
   ``min_sentences`` and more than one sentence of the document remains (else the tail joins
   this sample); the document's end closes the last sample. The target is ``seq_length - 3`` (room for [CLS], [SEP], [SEP]), or with probability
   ``short_seq_prob`` (one draw in ``round(1 / short_seq_prob)``) a length uniform in
   ``[2, seq_length - 3]``. Map rows ``(first sentence, end sentence, target length)`` are
   shuffled with ``RandomState(seed + 1)``. The random stream is numpy's, not Megatron's C++
   ``mt19937``, so maps follow the same rules but are not bit-identical to Megatron's.
2. **Sample ``idx``** (Megatron's ``build_training_sample``, ``RandomState(seed + idx)``): split
   the sentences at a random point into A and B (A = the first sentence if there are only two);
   with probability 0.5 swap them (``is_random = 1``: sentence order reversed); truncate the
   longer segment one token at a time, from the front or back at random, to the target length;
   build ``[CLS] A [SEP] B [SEP]`` with token types 0 (CLS, A, first SEP) and 1 (B, last SEP);
   mask with :func:`pretrain.data.masking.create_masked_lm_predictions` (up to
   ``masked_lm_prob * target`` predictions); pad to ``seq_length``. Without the binary head
   all sentences form segment A: ``[CLS] A [SEP]``.

Sample dict (torch): ``tokens``, ``tokentype_ids``, ``attention_mask`` (1 = real token),
``labels`` (original id at masked positions, -1 elsewhere), ``loss_mask`` (float, 1 at masked
positions), all ``[seq_length]``; ``is_random`` (0-dim, the sentence-order label).

The map is cached as ``.npy`` in ``cache_dir`` under a hash of what it depends on (the ``.idx``
content, the split's documents, ``seq_length``, ``seed``, ``num_samples``, ``short_seq_prob``,
``binary_head``); see :mod:`pretrain.data.gpt_dataset` for the atomic cache protocol.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pretrain.data.index_cache import IndexCache, file_digest
from pretrain.data.indexed_dataset import IndexedDataset, index_file_path
from pretrain.data.masking import BertVocab, create_masked_lm_predictions
from pretrain.utils.errors import UserError

_MAP_VERSION = 1  # bump when the construction of the sample map changes
LONG_SENTENCE_LEN = 512  # Megatron skips documents holding a longer sentence


@dataclass(frozen=True, kw_only=True)
class BertDatasetConfig:
    """Everything BERT samples depend on besides the data and the vocabulary."""

    seq_length: int
    seed: int = 1234
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    max_ngrams: int = 3
    whole_word_masking: bool = True
    binary_head: bool = True
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if int(self.seq_length) < 5:
            raise UserError(f"--seq-length {self.seq_length}: BERT samples need at least 5 tokens")
        if not 0.0 <= self.masked_lm_prob < 1.0:
            raise UserError(f"--mask-prob must be in [0, 1), got {self.masked_lm_prob}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise UserError(f"--short-seq-prob must be in [0, 1], got {self.short_seq_prob}")
        if self.max_ngrams < 1:
            raise UserError(f"max n-gram length must be >= 1, got {self.max_ngrams}")

    @property
    def min_sentences(self) -> int:
        return 2 if self.binary_head else 1


# --------------------------------------------------------------------------------------------- map


def _target_length(ratio: int, max_len: int, rng: np.random.RandomState) -> int:
    """``max_len``, or with probability ``1 / ratio`` a length uniform in ``[2, max_len]``."""
    if ratio == 0:
        return max_len
    r = int(rng.randint(0, 2**31 - 1))
    return 2 + r % (max_len - 1) if r % ratio == 0 else max_len


def build_sample_map(
    sentence_lengths: np.ndarray,
    document_indices: np.ndarray,
    documents: np.ndarray,
    *,
    max_len: int,
    short_seq_prob: float,
    min_sentences: int,
    num_samples: int | None,
    seed: int,
) -> np.ndarray:
    """int64 ``[N, 3]`` rows ``(first sentence, end sentence (exclusive), target length)``, shuffled."""
    rng = np.random.RandomState(seed % 2**32)
    ratio = int(round(1.0 / short_seq_prob)) if short_seq_prob > 0 else 0
    usable = []
    for d in documents:
        lo, hi = int(document_indices[d]), int(document_indices[d + 1])
        # As Megatron, the long-sentence rule applies to multi-sentence documents only (a lone
        # sentence is simply truncated).
        too_long = hi - lo > 1 and int(sentence_lengths[lo:hi].max()) > LONG_SENTENCE_LEN
        if hi - lo >= min_sentences and not too_long:
            usable.append((lo, hi))
    rows: list[tuple[int, int, int]] = []
    while True:
        before = len(rows)
        for lo, hi in usable:
            start, seq_len, num_sent = lo, 0, 0
            target = _target_length(ratio, max_len, rng)
            for s in range(lo, hi):
                seq_len += int(sentence_lengths[s])
                num_sent += 1
                remaining = hi - s - 1
                if (seq_len >= target and remaining > 1 and num_sent >= min_sentences) or remaining == 0:
                    rows.append((start, s + 1, target))
                    start, seq_len, num_sent = s + 1, 0, 0
                    target = _target_length(ratio, max_len, rng)
        if len(rows) == before or num_samples is None or len(rows) >= num_samples:
            break
    out = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    np.random.RandomState((seed + 1) % 2**32).shuffle(out)
    return out


# --------------------------------------------------------------------------------------------- sample


def _split_segments(
    sentences: list[list[int]], rng: np.random.RandomState
) -> tuple[list[int], list[int], bool]:
    """A = sentences before a random split point, B = the rest; swapped with probability 0.5."""
    a_end = int(rng.randint(1, len(sentences))) if len(sentences) >= 3 else 1
    a = [t for s in sentences[:a_end] for t in s]
    b = [t for s in sentences[a_end:] for t in s]
    is_random = bool(rng.random_sample() < 0.5)
    return (b, a, True) if is_random else (a, b, False)


def truncate_segments(a: list[int], b: list[int], max_tokens: int, rng: np.random.RandomState) -> bool:
    """Trim the longer of ``a``/``b`` (in place) one token at a time, front or back at random."""
    if len(a) + len(b) <= max_tokens:
        return False
    while len(a) + len(b) > max_tokens:
        seg = a if len(a) > len(b) else b
        if rng.random_sample() < 0.5:
            del seg[0]
        else:
            seg.pop()
    return True


def build_training_sample(
    sentences: list[list[int]],
    target_length: int,
    config: BertDatasetConfig,
    vocab: BertVocab,
    rng: np.random.RandomState,
) -> dict[str, torch.Tensor]:
    """One sample (see the module docstring) from its sentences."""
    if config.binary_head:
        a, b, is_random = _split_segments(sentences, rng)
    else:
        a, b, is_random = [t for s in sentences for t in s], [], False
    truncate_segments(a, b, target_length, rng)
    tokens = [vocab.cls, *a, vocab.sep] + ([*b, vocab.sep] if b else [])
    types = [0] * (len(a) + 2) + [1] * (len(b) + 1 if b else 0)
    tokens, positions, labels = create_masked_lm_predictions(
        tokens, vocab, masked_lm_prob=config.masked_lm_prob, max_predictions=int(config.masked_lm_prob * target_length),
        rng=rng, max_ngrams=config.max_ngrams, whole_word=config.whole_word_masking,
    )  # fmt: skip
    return pad_sample(tokens, types, positions, labels, is_random, config.seq_length, vocab.pad)


def pad_sample(
    tokens: list[int], types: list[int], positions: list[int], labels: list[int], is_random: bool,
    seq_length: int, pad_id: int,
) -> dict[str, torch.Tensor]:  # fmt: skip
    n = len(tokens)
    if n > seq_length:  # pragma: no cover - guarded by the target length
        raise RuntimeError(f"BERT sample of {n} tokens exceeds seq_length {seq_length}")
    out_tokens = torch.full((seq_length,), pad_id, dtype=torch.int64)
    out_tokens[:n] = torch.tensor(tokens, dtype=torch.int64)
    out_types = torch.zeros(seq_length, dtype=torch.int64)
    out_types[:n] = torch.tensor(types, dtype=torch.int64)
    attention_mask = (torch.arange(seq_length) < n).long()
    out_labels = torch.full((seq_length,), -1, dtype=torch.int64)
    loss_mask = torch.zeros(seq_length, dtype=torch.float32)
    if positions:
        idx = torch.tensor(positions, dtype=torch.int64)
        out_labels[idx] = torch.tensor(labels, dtype=torch.int64)
        loss_mask[idx] = 1.0
    return {
        "tokens": out_tokens, "tokentype_ids": out_types, "attention_mask": attention_mask,
        "labels": out_labels, "loss_mask": loss_mask, "is_random": torch.tensor(int(is_random)),
    }  # fmt: skip


# --------------------------------------------------------------------------------------------- dataset


def _documents_key(docs: np.ndarray) -> Any:
    if docs.size and np.array_equal(docs, np.arange(int(docs[0]), int(docs[0]) + docs.size)):
        return {"range": [int(docs[0]), int(docs[0]) + int(docs.size)]}
    return {
        "digest": hashlib.md5(docs.astype("<i8").tobytes(), usedforsecurity=False).hexdigest(),
        "n": int(docs.size),
    }


class BertDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """BERT samples from the ``documents`` (default: all) of one split of an indexed dataset.

    ``len(ds)`` counts every sample of the epochs built (at least ``num_samples``).
    ``ds[idx]`` is deterministic: a function of ``config.seed``, ``idx`` and the data.
    """

    def __init__(
        self, indexed: IndexedDataset | str, config: BertDatasetConfig, vocab: BertVocab, *,
        documents: np.ndarray | None = None, num_samples: int | None = None, split: str = "train",
    ) -> None:  # fmt: skip
        self.indexed = indexed if isinstance(indexed, IndexedDataset) else IndexedDataset(indexed)
        self.config, self.vocab, self.split = config, vocab, split
        n_docs = self.indexed.num_documents
        docs = (
            np.arange(n_docs, dtype=np.int64) if documents is None else np.asarray(documents, dtype=np.int64)
        )
        if docs.size and (docs.min() < 0 or docs.max() >= n_docs):
            raise ValueError(f"document ids out of range for {n_docs} documents")
        desc = {
            "class": "BertDataset", "version": _MAP_VERSION,
            "index_file_digest": file_digest(index_file_path(self.indexed.prefix)), "split": split,
            "documents": _documents_key(docs), "seq_length": int(config.seq_length), "seed": int(config.seed),
            "num_samples": None if num_samples is None else int(num_samples),
            "short_seq_prob": float(config.short_seq_prob), "binary_head": bool(config.binary_head),
        }  # fmt: skip
        cache = IndexCache(config.cache_dir, "BertDataset", split, desc, ("sample_map",))
        loaded = cache.load()
        self.cache_hit = loaded is not None
        if loaded is None:
            loaded = {"sample_map": self._build_map(docs, num_samples)}
            cache.save(loaded)
        self.cache_paths = dict(cache.paths)
        self.sample_map = loaded["sample_map"]

    def _build_map(self, docs: np.ndarray, num_samples: int | None) -> np.ndarray:
        out = build_sample_map(
            self.indexed.sequence_lengths, self.indexed.document_indices, docs,
            max_len=self.config.seq_length - 3, short_seq_prob=self.config.short_seq_prob,
            min_sentences=self.config.min_sentences, num_samples=num_samples, seed=self.config.seed,
        )  # fmt: skip
        if out.shape[0] == 0:
            raise UserError(
                f"{index_file_path(self.indexed.prefix)}: the {self.split} split ({docs.size} documents) has no "
                f"document with at least {self.config.min_sentences} sentences of <= {LONG_SENTENCE_LEN} "
                "tokens; was the data preprocessed with --split-sentences?"
            )
        return out

    def __len__(self) -> int:
        return int(self.sample_map.shape[0])

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        i = int(idx)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} BERT samples ({self.split})")
        start, end, target = (int(x) for x in self.sample_map[i])
        sentences = [np.asarray(self.indexed[s]).tolist() for s in range(start, end)]
        rng = np.random.RandomState((int(self.config.seed) + i) % 2**32)
        return build_training_sample(sentences, target, self.config, self.vocab, rng)
