"""GPT sample index maps (Megatron's construction, numpy-vectorised): the per-epoch document order,
where each sample starts in the token stream, and the sample shuffle (see :mod:`pretrain.data.gpt_dataset`)."""

from __future__ import annotations

import numpy as np


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState) -> np.ndarray:
    """``num_epochs`` independent permutations of ``documents``, concatenated."""
    dtype = np.int32 if (documents.size == 0 or int(documents.max()) < 2**31 - 1) else np.int64
    out = np.empty(num_epochs * documents.size, dtype=dtype)
    for e in range(num_epochs):
        perm = documents.astype(dtype, copy=True)
        rng.shuffle(perm)
        out[e * documents.size : (e + 1) * documents.size] = perm
    return out


def build_sample_index(doc_lengths: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """int64 [num_samples + 1, 2]: start of sample j (and inclusive end of sample j - 1) as
    (position in ``document_index``, token offset in that document); num_samples = (T - 1) // s
    for the T tokens of the stream."""
    lens = doc_lengths[document_index].astype(np.int64)
    cum_end = np.cumsum(lens)
    total = int(cum_end[-1]) if cum_end.size else 0
    num_samples = max(total - 1, 0) // seq_length
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    if total == 0:
        return np.zeros((1, 2), dtype=np.int64)
    k = np.searchsorted(cum_end, positions, side="right")
    offsets = positions - (cum_end[k] - lens[k])
    return np.stack([k.astype(np.int64), offsets], axis=1)


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of ``[0, num_samples)``, then a separate permutation of ``[num_samples, total_size)``."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int | None) -> int:
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))
