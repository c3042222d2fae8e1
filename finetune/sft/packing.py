"""Samples -> fixed-length rows: one sample per row (padded), or several per row (``--pack``).

Each row holds ``tokens``, ``labels``, ``loss_mask`` ``[s]``; packed rows add ``position_ids``
(restarting at 0 for every sample, so RoPE and learned positions see each sample as if alone)
and ``segments`` (the sample index in the row; padding is segment -1), from which
:func:`block_causal_mask` builds the attention mask: a token attends only to earlier tokens of its
own sample. A sample's ``n`` ids become its ``n - 1`` (input, label) pairs, so the ids at sample
boundaries are all kept: a sample's first id is an input, its last id (EOS) a label.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from finetune.sft.samples import Sample

Rows = dict[str, torch.Tensor]


def _empty(rows: int, seq_length: int, pad_id: int) -> dict[str, np.ndarray]:
    return {"tokens": np.full((rows, seq_length), pad_id, dtype=np.int64),
            "labels": np.zeros((rows, seq_length), dtype=np.int64),
            "loss_mask": np.zeros((rows, seq_length), dtype=np.float32)}  # fmt: skip


def _put(out: dict[str, np.ndarray], row: int, start: int, s: Sample) -> int:
    end = start + s.predictions
    out["tokens"][row, start:end] = s.ids[:-1]
    out["labels"][row, start:end] = s.ids[1:]
    out["loss_mask"][row, start:end] = s.loss[1:]
    return end


def pad_rows(samples: Sequence[Sample], seq_length: int, pad_id: int) -> Rows:
    """One sample per row, padded at the end with ``pad_id`` (no loss there): ``[n, s]`` each."""
    out = _empty(len(samples), seq_length, pad_id)
    for row, s in enumerate(samples):
        _put(out, row, 0, s)
    return {k: torch.from_numpy(v) for k, v in out.items()}


def pack_groups(samples: Sequence[Sample], seq_length: int) -> list[list[int]]:
    """Sample indices per row, in file order: a row is closed when the next sample does not fit."""
    groups: list[list[int]] = [[]]
    used = 0
    for i, s in enumerate(samples):
        if used + s.predictions > seq_length and groups[-1]:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += s.predictions
    return groups


def pack_rows(samples: Sequence[Sample], seq_length: int, pad_id: int) -> Rows:
    """Several samples per row (see the module docstring): ``[rows, s]`` each."""
    groups = pack_groups(samples, seq_length)
    out = _empty(len(groups), seq_length, pad_id)
    out["position_ids"] = np.tile(np.arange(seq_length, dtype=np.int64), (len(groups), 1))
    out["segments"] = np.full((len(groups), seq_length), -1, dtype=np.int64)
    for row, group in enumerate(groups):
        start = 0
        for k, i in enumerate(group):
            end = _put(out, row, start, samples[i])
            out["position_ids"][row, start:end] = np.arange(end - start)
            out["segments"][row, start:end] = k
            start = end
        out["position_ids"][row, start:] = np.arange(seq_length - start)
    return {k: torch.from_numpy(v) for k, v in out.items()}


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """Bool ``[b, 1, s, s]`` (True = may attend): causal and within the same segment ``[b, s]``."""
    s = segments.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    return (same & causal)[:, None]
