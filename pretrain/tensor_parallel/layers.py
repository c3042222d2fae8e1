"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Each parallel parameter carries ``tp_partition_dim`` (0 or 1; ``None`` for replicated tensors)
so checkpoint tools and tests can split and re-assemble full tensors without knowing the layer.
Parameters are created empty; :mod:`pretrain.models.init` fills them from full tensors so that
every layout starts from the same function.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
)
from pretrain.tensor_parallel.sequence_parallel import (
    mark_sequence_parallel,
    reduce_scatter_to_sequence_region,
    sequence_parallel_linear,
)
from pretrain.tensor_parallel.vocab import vocab_range


def mark_partition(param: torch.Tensor, dim: int | None) -> Any:
    param.tp_partition_dim = dim  # type: ignore[attr-defined]
    return param


def partition_dim(param: torch.Tensor) -> int | None:
    return getattr(param, "tp_partition_dim", None)


def mark_expert(param: torch.Tensor) -> Any:
    """Flag a routed expert's parameter: its gradient is reduced (and ZeRO-1 sharded) over the
    expert data-parallel group, not the dense one (megatron-core's ``allreduce=False``)."""
    param.is_expert = True  # type: ignore[attr-defined]
    return param


def is_expert(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to a routed expert (see :func:`mark_expert`)."""
    return bool(getattr(param, "is_expert", False))


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} {n} is not divisible by tensor-parallel size {d}")
    return n // d


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by columns: weight ``[out/t, in]``, bias ``[out/t]``.

    Input ``[..., in]`` (replicated on TP ranks); output ``[..., out/t]``, or ``[..., out]`` when
    ``gather_output``. Collectives: f (backward all-reduce of the input grad over the TP group);
    an all-gather of the output when ``gather_output``. ``local_output_size`` overrides ``out/t``
    for layers whose shards are not a plain split (fused QKV with replicated key/value heads).
    With ``sequence_parallel`` the input is this rank's sequence shard ``[b, s/t, in]``, all-gathered
    in forward (and again in backward) and reduce-scattered in backward, in place of f.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        ps: ParallelState,
        bias: bool = True,
        gather_output: bool = False,
        dtype: torch.dtype = torch.float32,
        local_output_size: int | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group = ps.tp_group
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        local_out = (
            _divide(output_size, ps.tp_size, "output size")
            if local_output_size is None
            else local_output_size
        )
        kw: dict[str, Any] = {"device": ps.device, "dtype": dtype}
        self.weight = mark_partition(nn.Parameter(torch.empty(local_out, input_size, **kw)), 0)
        self.bias = mark_partition(nn.Parameter(torch.empty(local_out, **kw)), 0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = sequence_parallel_linear(x, self.weight, self.bias, self.group)
        else:
            y = F.linear(copy_to_tp_region(x, self.group), self.weight, self.bias)
        return gather_from_tp_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by rows: weight ``[out, in/t]``, bias ``[out]`` replicated.

    Input ``[..., in/t]`` (already split, e.g. the output of a column-parallel layer) or full
    ``[..., in]`` when ``input_is_parallel=False``; output ``[..., out]``. Collectives: g (forward
    all-reduce over the TP group); the bias is added after the reduction so it is counted once.
    With ``sequence_parallel`` the reduction is a reduce-scatter along the sequence (output
    ``[b, s/t, out]``) and the bias, added on the shard, is marked ``sequence_parallel``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        ps: ParallelState,
        bias: bool = True,
        input_is_parallel: bool = True,
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group = ps.tp_group
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        local_in = _divide(input_size, ps.tp_size, "input size")
        kw: dict[str, Any] = {"device": ps.device, "dtype": dtype}
        self.weight = mark_partition(nn.Parameter(torch.empty(output_size, local_in, **kw)), 1)
        self.bias = mark_partition(nn.Parameter(torch.empty(output_size, **kw)), None) if bias else None
        if self.bias is not None and sequence_parallel and ps.tp_size > 1:
            mark_sequence_parallel(self.bias)

    def forward_no_bias(self, x: torch.Tensor) -> torch.Tensor:
        """The reduced output without the bias (for fused bias-dropout-add)."""
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(F.linear(x, self.weight), self.group)
        return reduce_from_tp_region(F.linear(x, self.weight), self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.forward_no_bias(x)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding with the (padded) vocabulary split by rows: weight ``[V/t, h]``.

    Input ids ``[...]``; output ``[..., h]``. Each rank looks up the ids in its range
    ``[start, end)``, zeroes the others, and the TP group all-reduces (g), or with
    ``sequence_parallel`` reduce-scatters along the sequence: output ``[b, s/t, h]``.
    """

    def __init__(
        self, padded_vocab: int, hidden: int, *, ps: ParallelState, dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.group = ps.tp_group
        self.tp_size = ps.tp_size
        self.sequence_parallel = sequence_parallel
        self.start, self.end = vocab_range(padded_vocab, tp_rank=ps.tp_rank, tp=ps.tp_size)
        w = torch.empty(self.end - self.start, hidden, device=ps.device, dtype=dtype)
        self.weight = mark_partition(nn.Parameter(w), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.group)
        return reduce_from_tp_region(out, self.group)
