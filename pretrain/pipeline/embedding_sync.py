"""Tied word embeddings across the first and last pipeline stage (the embedding group)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from pretrain.models.base import ShardedModule
from pretrain.parallel.state import ParallelState


def shared_embedding(chunks: Sequence[ShardedModule], ps: ParallelState) -> torch.Tensor | None:
    """The tied embedding weight this rank holds in the embedding group (None if it holds none)."""
    if ps.pp_size == 1 or ps.embedding_group is None:
        return None
    if ps.is_first_stage:
        return chunks[0].shared_embedding_weight()  # type: ignore[operator]
    if ps.is_last_stage:
        return chunks[-1].shared_embedding_weight()  # type: ignore[operator]
    return None


def allreduce_embedding_grads(chunks: Sequence[ShardedModule], ps: ParallelState) -> None:
    """Sum the tied embedding's gradient over the first and last stage (one all-reduce).

    Works on ``main_grad`` (data-parallel buffers) when present, else on ``.grad``. Call once
    per step after the last microbatch's backward.
    """
    weight = shared_embedding(chunks, ps)
    if weight is None:
        return
    grad = getattr(weight, "main_grad", None)
    if grad is None:
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        grad = weight.grad
    dist.all_reduce(grad, group=ps.embedding_group)


@torch.no_grad()
def sync_embedding_weights(chunks: Sequence[ShardedModule], ps: ParallelState) -> None:
    """Make the last stage's ``word_embeddings_for_head`` equal to the first stage's embeddings."""
    weight = shared_embedding(chunks, ps)
    if weight is None:
        return
    if not ps.is_first_stage:
        weight.zero_()
    dist.all_reduce(weight, group=ps.embedding_group)
