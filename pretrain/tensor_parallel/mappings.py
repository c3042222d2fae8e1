"""The conjugate operators f and g of the paper (figure 3) and split/gather along the last dim.

* ``copy_to_tp_region`` (f): identity forward, all-reduce of the gradient backward.
* ``reduce_from_tp_region`` (g): all-reduce forward, identity backward.
* ``scatter_to_tp_region``: keep this rank's slice of the last dim; backward all-gathers.
* ``gather_from_tp_region``: all-gather along the last dim; backward keeps this rank's slice.

Every function takes the tensor-parallel group explicitly; ``None`` (or a group of size one)
means no communication.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place (no-op for a single rank)."""
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[-1] % n:
        raise ValueError(f"last dim {x.shape[-1]} not divisible by tensor-parallel size {n}")
    return x.chunk(n, dim=-1)[group_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


class _CopyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad, ctx.group), None


class _GatherFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """f: identity forward; backward all-reduces the gradient over ``group``."""
    return x if group_size(group) == 1 else _CopyToTPRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """g: all-reduce forward over ``group``; identity backward."""
    return x if group_size(group) == 1 else _ReduceFromTPRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's chunk of the last dim; backward all-gathers over ``group``."""
    return x if group_size(group) == 1 else _ScatterToTPRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-gather the last dim over ``group``; backward keeps this rank's chunk."""
    return x if group_size(group) == 1 else _GatherFromTPRegion.apply(x, group)
