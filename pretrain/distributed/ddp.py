"""Data parallelism over contiguous gradient buffers (Megatron-LM's "local" DDP).

Convention: the loss of every microbatch is its masked *sum* of per-token losses divided by the
number of loss tokens of the whole global batch (all microbatches on all data-parallel ranks,
see :func:`global_loss_tokens`). Each rank's accumulated gradient is then its share of the
global-batch gradient, so the data-parallel reduction is a **SUM** (not an average): after it,
every rank holds exactly the gradient one process would compute on the whole global batch.

Routed experts' parameters (:func:`~pretrain.tensor_parallel.layers.is_expert`) live in buffers of
their own, reduced (and ZeRO-1 sharded) over the expert data-parallel group ``ps.edp_group``
instead (megatron-core's expert-DP): with expert parallelism a replica of an expert shard exists
only on ``EDP = t d / (ETP EP)`` ranks.

Collectives (all over ``ps.dp_group``, expert buffers over ``ps.edp_group``): one all-reduce per bucket, or with the distributed
optimizer one reduce-scatter per bucket (rank k then holds the summed gradient of its shard
only; the rest of its buffer keeps stale local values). With ``overlap_grad_reduce`` a bucket's
collective is launched asynchronously as soon as all its parameters have their gradients for the
last microbatch; :meth:`DistributedDataParallel.finish_grad_sync` waits for all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pretrain.distributed.grad_buffer import Bucket, GradBuffer, register_grad_accumulation_hooks
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.layers import is_expert
from pretrain.utils.errors import UserError

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """``grad_reduce_in_fp32``: fp32 gradient buffers whatever the parameter dtype (False: the
    parameter dtype, e.g. fp16 grads). ``bucket_size``: elements per bucket (None: one bucket per
    buffer). ``shard_alignment``: each rank's shard of a bucket is a multiple of this many
    elements. ``use_distributed_optimizer``: reduce-scatter instead of all-reduce, and keep the
    parameters in flat buffers so updated shards can be all-gathered."""

    grad_reduce_in_fp32: bool = True
    overlap_grad_reduce: bool = False
    use_distributed_optimizer: bool = False
    bucket_size: int | None = None
    shard_alignment: int = 128

    def __post_init__(self) -> None:
        if self.bucket_size is not None and self.bucket_size < 1:
            raise UserError(f"ddp config: bucket_size must be >= 1 or None, got {self.bucket_size}")
        if self.shard_alignment < 1:
            raise UserError(f"ddp config: shard_alignment must be >= 1, got {self.shard_alignment}")


def global_loss_tokens(loss_masks: Sequence[torch.Tensor], ps: ParallelState) -> float:
    """Number of loss tokens in the global batch: local masks summed, all-reduced (SUM) over DP.

    ``loss_masks``: this rank's microbatch masks ``[b, s]``. Collective: one all-reduce of a
    scalar over ``ps.dp_group``.
    """
    total = torch.zeros((), dtype=torch.float64, device=ps.device)
    for m in loss_masks:
        total += m.to(torch.float64).sum()
    if ps.dp_group is not None:
        dist.all_reduce(total, group=ps.dp_group)
    return float(total)


def _shared_embedding_ids(module: nn.Module, ps: ParallelState) -> set[int]:
    """Parameters whose gradient the pipeline all-reduces in the embedding group (pp > 1)."""
    if ps.pp_size == 1 or not hasattr(module, "shared_embedding_weight"):
        return set()
    if not (getattr(module, "pre_process", False) or getattr(module, "post_process", False)):
        return set()
    shared = getattr(module, "shared_embedding_weight")  # noqa: B009 (nn.Module's __getattr__)
    return {id(shared())}


class DistributedDataParallel:
    """Gradient buffers, accumulation hooks and the data-parallel reduction of one model chunk.

    The module itself is not wrapped (pipeline code keeps using it); calling this object calls
    the module. Parameters are grouped into one :class:`GradBuffer` per (param dtype, grad
    dtype), in order of first appearance.
    """

    def __init__(self, module: nn.Module, ps: ParallelState, config: DDPConfig | None = None) -> None:
        self.module, self.ps = module, ps
        self.config = config or DDPConfig()
        self.dp_size = ps.dp_size
        by_dtype: dict[tuple[torch.dtype, torch.dtype, bool], list[nn.Parameter]] = {}
        for p in module.parameters():
            if p.requires_grad:
                grad_dtype = torch.float32 if self.config.grad_reduce_in_fp32 else p.dtype
                by_dtype.setdefault((p.dtype, grad_dtype, is_expert(p)), []).append(p)
        self.buffers = [
            GradBuffer(
                params,
                grad_dtype=grad_dtype,
                dp_size=ps.edp_size if expert else self.dp_size,
                bucket_size=self.config.bucket_size,
                shard_alignment=self.config.shard_alignment,
                with_param_buffer=self.config.use_distributed_optimizer,
            )
            for (_, grad_dtype, expert), params in by_dtype.items()
        ]
        # per buffer: (group, rank, size) of its data-parallel reduction
        self.buffer_dp = [
            (ps.edp_group, ps.edp_rank, ps.edp_size) if expert else (ps.dp_group, ps.dp_rank, ps.dp_size)
            for (_, _, expert) in by_dtype
        ]
        self._dp_of = {
            id(b): dp for buf, dp in zip(self.buffers, self.buffer_dp, strict=True) for b in buf.buckets
        }
        self._buckets: list[Bucket] = [b for buf in self.buffers for b in buf.buckets]
        self._bucket_of = {pid: b for buf in self.buffers for pid, b in buf.bucket_of.items()}
        self._params = [p for buf in self.buffers for p in buf.params]
        # With reduce-scatter the shared embedding must be summed over the embedding group
        # *before* the DP reduction (shards of different stages cover different elements), so
        # buckets holding it are never launched early; see finalize_model_grads.
        shared = _shared_embedding_ids(module, ps) if self.config.use_distributed_optimizer else set()
        self._deferred = {id(self._bucket_of[i]) for i in shared if i in self._bucket_of}
        self._next_launch = 0
        self._handles: list[tuple[Any, torch.Tensor | None, Bucket]] = []
        self._sync_enabled = True
        self.grad_accumulation_steps = 1  # hook calls per parameter before its bucket is ready
        self._hooks = register_grad_accumulation_hooks(self._params, self._on_grad_accumulated)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # --- step boundaries ----------------------------------------------------------------------
    def zero_grad_buffer(self) -> None:
        """Zero all gradient buffers and per-step state; call before the first microbatch."""
        if self._handles:
            raise RuntimeError("zero_grad_buffer called while gradient reductions are in flight")
        for buf in self.buffers:
            buf.reset()
        for p in self._params:
            p.grad = None
        self._next_launch = 0

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate without counting towards bucket readiness (all but the last microbatch)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # --- hooks and overlap --------------------------------------------------------------------
    def _on_grad_accumulated(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        if bucket.launched:
            raise RuntimeError(
                "a gradient arrived after its bucket's reduction was launched: wrap all but the "
                "last microbatch in no_sync(), or set grad_accumulation_steps to the number of "
                "microbatches"
            )
        if not (self.config.overlap_grad_reduce and self._sync_enabled):
            return
        bucket.ready_count[id(param)] = bucket.ready_count.get(id(param), 0) + 1
        self._launch_ready()

    def _bucket_ready(self, bucket: Bucket) -> bool:
        if id(bucket) in self._deferred:
            return False
        need = self.grad_accumulation_steps
        return all(bucket.ready_count.get(id(p), 0) >= need for p in bucket.params)

    def _launch_ready(self) -> None:
        # Launch strictly in bucket order so every DP rank issues collectives in the same order.
        while self._next_launch < len(self._buckets) and self._bucket_ready(self._buckets[self._next_launch]):
            self._launch(self._buckets[self._next_launch], async_op=True)
            self._next_launch += 1

    def _launch(self, bucket: Bucket, *, async_op: bool) -> None:
        bucket.launched = True
        group, _, size = self._dp_of[id(bucket)]
        if group is None:
            return
        if not self.config.use_distributed_optimizer:
            self._handles.append((dist.all_reduce(bucket.grad, group=group, async_op=async_op), None, bucket))
            return
        # Reduce into a fresh shard-sized tensor: in-place reduce-scatter is not portable (gloo).
        out = torch.empty(bucket.size // size, dtype=bucket.grad.dtype, device=bucket.grad.device)
        work = _reduce_scatter(out, bucket.grad, group=group, async_op=async_op)
        self._handles.append((work, out, bucket))

    # --- synchronisation ----------------------------------------------------------------------
    def start_grad_sync(self) -> None:
        """Launch (asynchronously) the reduction of every bucket not launched yet, in order."""
        for bucket in self._buckets[self._next_launch :]:
            self._launch(bucket, async_op=True)
        self._next_launch = len(self._buckets)

    def finish_grad_sync(self) -> None:
        """Launch what is left and wait: all-reduced buckets hold the global-batch gradient;
        reduce-scattered buckets hold it in this rank's shard only."""
        self.start_grad_sync()
        for work, out, bucket in self._handles:
            if work is not None:
                work.wait()
            if out is not None:
                _, rank, size = self._dp_of[id(bucket)]
                shard = bucket.shard_range(rank, size)
                bucket.grad[shard.start - bucket.start : shard.end - bucket.start].copy_(out)
        self._handles.clear()

    # --- distributed optimizer support --------------------------------------------------------
    def all_gather_params(self) -> None:
        """All-gather every bucket's parameter shards over its DP group (after a ZeRO-1 step)."""
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        for bucket in self._buckets:
            group, rank, size = self._dp_of[id(bucket)]
            if group is None:
                continue
            assert bucket.param_data is not None, "all_gather_params needs use_distributed_optimizer"
            shard = bucket.shard_range(rank, size)
            local = bucket.param_data[shard.start - bucket.start : shard.end - bucket.start].clone()
            gather(bucket.param_data, local, group=group)


def finalize_model_grads(
    ddps: Sequence[DistributedDataParallel], *, embedding_sync: Callable[[], None] | None = None
) -> None:
    """Finish the DP reduction of every chunk and the pipeline's tied-embedding all-reduce.

    Without the distributed optimizer the order does not matter (both are sums); with it the
    embedding sync (on full local ``main_grad`` tensors) must come first, because after the
    reduce-scatter each rank holds only its own shard.
    """
    distributed = any(d.config.use_distributed_optimizer for d in ddps)
    if distributed and embedding_sync is not None:
        embedding_sync()
    for d in ddps:
        d.finish_grad_sync()
    if not distributed and embedding_sync is not None:
        embedding_sync()
