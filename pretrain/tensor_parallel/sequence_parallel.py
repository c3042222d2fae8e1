"""Sequence parallelism (Korthikanti et al. 2022, section 4.2.2): the conjugate operators g and
ḡ along the sequence dimension, the column-parallel GEMM that re-gathers its input in backward,
and the gradient sum of the parameters that see only a sequence shard.

Activations are batch-first ``[b, s, h]``, so the sequence shard is dimension 1: rank ``r`` of
the TP group holds positions ``[r s/t, (r+1) s/t)``.

* ``scatter_to_sequence_region``: keep this rank's shard; backward all-gathers.
* ``gather_from_sequence_region``: all-gather the shards; backward keeps this rank's shard of the
  gradient (the consumer's gradient is already complete on every rank) or, with
  ``reduce_scatter_grad``, reduce-scatters it (each rank holds a partial gradient, g's conjugate).
* ``reduce_scatter_to_sequence_region`` (ḡ, after a row-parallel GEMM): reduce-scatter forward,
  all-gather backward.
* :func:`sequence_parallel_linear`: all-gather then ``x W^T + b`` (QKV, fc1). Only the shard is
  saved for backward and the gather is redone there, as Megatron does: saving the gathered input
  would keep ``t`` times the activation and undo the point of sequence parallelism.

Parameters replicated over TP but computed on sequence shards (the norms of the SP regions, the
row-parallel biases) carry ``sequence_parallel = True`` (Megatron's attribute); their gradient is
a per-rank partial sum, added over the TP group once per step by
:func:`allreduce_sequence_parallel_grads`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pretrain.tensor_parallel.mappings import ProcessGroup, group_rank, group_size

SEQ_DIM = 1
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _split_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[SEQ_DIM] % n:
        raise ValueError(f"sequence length {x.shape[SEQ_DIM]} not divisible by tensor-parallel size {n}")
    return x.chunk(n, dim=SEQ_DIM)[group_rank(group)].contiguous()


def _gather_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=SEQ_DIM)


def _reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[SEQ_DIM] % n:
        raise ValueError(f"sequence length {x.shape[SEQ_DIM]} not divisible by tensor-parallel size {n}")
    flat = x.movedim(SEQ_DIM, 0).contiguous()  # reduce_scatter_tensor splits dim 0
    out = flat.new_empty((flat.shape[0] // n, *flat.shape[1:]))
    _reduce_scatter(out, flat, group=group)
    return out.movedim(0, SEQ_DIM)


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_seq(grad, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup | None, reduce_scatter_grad: bool
    ) -> torch.Tensor:
        ctx.group, ctx.reduce_scatter_grad = group, reduce_scatter_grad
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.reduce_scatter_grad:
            return _reduce_scatter_seq(grad, ctx.group), None, None
        return _split_seq(grad, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_seq(grad, ctx.group), None


class _SequenceParallelLinear(torch.autograd.Function):
    """``all_gather(x) W^T + b`` saving the shard ``x [b, s/t, in]``, not the gathered input."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: ProcessGroup | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(_gather_seq(x, group), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = _reduce_scatter_seq(grad.matmul(weight), ctx.group) if need_x else None
        grad_w = grad_b = None
        if need_w:  # the gathered input was never kept: gather it again
            full = _gather_seq(x, ctx.group)
            grad_w = grad.flatten(0, -2).t().matmul(full.flatten(0, -2))
        if ctx.has_bias and need_b:
            grad_b = grad.flatten(0, -2).sum(0)
        return grad_x, grad_w, grad_b, None


def scatter_to_sequence_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``[b, s, h]`` -> this rank's ``[b, s/t, h]``; backward all-gathers the gradient."""
    return x if group_size(group) == 1 else _ScatterToSequence.apply(x, group)


def gather_from_sequence_region(
    x: torch.Tensor, group: ProcessGroup | None, *, reduce_scatter_grad: bool = False
) -> torch.Tensor:
    """``[b, s/t, h]`` -> ``[b, s, h]``; backward: this rank's shard of the (complete) gradient, or
    the reduce-scatter of partial gradients with ``reduce_scatter_grad``."""
    if group_size(group) == 1:
        return x
    return _GatherFromSequence.apply(x, group, reduce_scatter_grad)  # type: ignore[no-any-return]


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """ḡ: partial sums ``[b, s, h]`` -> this rank's shard of their sum ``[b, s/t, h]``."""
    return x if group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group)


def sequence_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: ProcessGroup | None
) -> torch.Tensor:
    """``x [b, s/t, in]`` all-gathered, times ``weight [out/t, in]``: ``[b, s, out/t]``."""
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    return _SequenceParallelLinear.apply(x, weight, bias, group)  # type: ignore[no-any-return]


def mark_sequence_parallel(module_or_param: nn.Module | torch.Tensor) -> None:
    """Set Megatron's ``sequence_parallel`` attribute on a parameter (or every parameter of a module)."""
    params = [module_or_param] if isinstance(module_or_param, torch.Tensor) else module_or_param.parameters()
    for p in params:
        p.sequence_parallel = True  # type: ignore[attr-defined]


def allreduce_sequence_parallel_grads(modules: Iterable[nn.Module], group: ProcessGroup | None) -> None:
    """Sum the gradients of every ``sequence_parallel`` parameter over the TP group (one coalesced
    all-reduce). Uses ``main_grad`` (data-parallel buffers) when present, else ``.grad``; call once
    per step after the last backward, where the tied-embedding sum runs (before a ZeRO-1
    reduce-scatter)."""
    if group_size(group) == 1:
        return
    grads = []
    for module in modules:
        for p in module.parameters():
            if getattr(p, "sequence_parallel", False):
                g = getattr(p, "main_grad", None)
                if g is None:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    g = p.grad
                grads.append(g)
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
