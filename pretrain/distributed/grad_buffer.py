"""Contiguous per-dtype gradient buffers (and, for ZeRO-1, parameter buffers) with buckets.

Layout (Megatron-LM's local DDP): parameters are laid out in *reverse* order of
``module.parameters()`` (roughly the order backward produces their gradients), so early buckets
are ready first. Each parameter's ``main_grad`` is a view ``[*param.shape]`` into the flat
buffer. The buffer is cut into buckets of whole parameters; every bucket is padded at its end to
a multiple of ``dp_size * shard_alignment`` elements, so each bucket (and therefore the buffer)
divides evenly into ``dp_size`` equal shards. With one bucket (the default) data-parallel rank k
owns buffer elements ``[k*G/d, (k+1)*G/d)``; with several buckets it owns the k-th shard of every
bucket. Padding elements are always zero.

Gradient accumulation: a hook registered with ``register_post_accumulate_grad_hook`` adds each
new ``param.grad`` into ``param.main_grad`` (fp32 by default, whatever the parameter dtype) and
frees ``param.grad``, so only one gradient copy per parameter stays alive.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Range:
    """A half-open element range ``[start, end)``."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def normalize(self, start: int = 0) -> Range:
        """The same size, shifted to begin at ``start``."""
        return Range(start, start + self.size)


@dataclass(eq=False)
class Bucket:
    """Whole parameters occupying ``buffer[start:end]`` (``end`` includes the bucket's padding)."""

    index: int
    params: list[nn.Parameter]
    start: int
    end: int
    grad: torch.Tensor  # view of the buffer's grad data [end - start]
    param_data: torch.Tensor | None  # view of the buffer's param data, or None
    ready_count: dict[int, int] = field(default_factory=dict)  # id(param) -> hook calls
    launched: bool = False

    @property
    def size(self) -> int:
        return self.end - self.start

    def shard_range(self, dp_rank: int, dp_size: int) -> Range:
        """Buffer (world) range of ``dp_rank``'s shard of this bucket."""
        per = self.size // dp_size
        return Range(self.start + dp_rank * per, self.start + (dp_rank + 1) * per)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class GradBuffer:
    """One flat gradient buffer for the parameters of one (param dtype, grad dtype) pair.

    ``params`` are given in ``module.parameters()`` order. ``bucket_size`` (elements, ``None`` =
    one bucket) bounds bucket contents before padding. With ``with_param_buffer`` the parameters
    are also moved into one flat ``param_data`` buffer of the same layout (``param.data``
    becomes a view), so ZeRO-1 can all-gather updated shards straight into the model.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        grad_dtype: torch.dtype,
        dp_size: int,
        bucket_size: int | None = None,
        shard_alignment: int = 1,
        with_param_buffer: bool = False,
    ) -> None:
        if not params:
            raise ValueError("GradBuffer needs at least one parameter")
        self.param_dtype = params[0].dtype
        if any(p.dtype != self.param_dtype for p in params):
            raise ValueError("all parameters of one GradBuffer must share a dtype")
        self.grad_dtype, self.dp_size = grad_dtype, dp_size
        self.params = list(params)
        self.numel_unpadded = sum(p.numel() for p in params)
        self.index: dict[int, Range] = {}  # id(param) -> buffer range
        groups, spans = self._plan(list(reversed(self.params)), bucket_size, dp_size * shard_alignment)
        self.numel = spans[-1][1]
        device = params[0].device
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data = (
            torch.zeros(self.numel, dtype=self.param_dtype, device=device) if with_param_buffer else None
        )
        self.buckets = [
            Bucket(
                index=i,
                params=group,
                start=start,
                end=end,
                grad=self.grad_data[start:end],
                param_data=None if self.param_data is None else self.param_data[start:end],
            )
            for i, (group, (start, end)) in enumerate(zip(groups, spans, strict=True))
        ]
        self.bucket_of: dict[int, Bucket] = {id(p): b for b in self.buckets for p in b.params}
        self._attach_views()

    def _plan(
        self, ordered: list[nn.Parameter], bucket_size: int | None, pad_multiple: int
    ) -> tuple[list[list[nn.Parameter]], list[tuple[int, int]]]:
        """Assign buffer ranges (reverse order) and cut buckets of whole parameters."""
        groups: list[list[nn.Parameter]] = [[]]
        spans: list[tuple[int, int]] = []
        bucket_start = offset = 0
        for p in ordered:
            self.index[id(p)] = Range(offset, offset + p.numel())
            offset += p.numel()
            groups[-1].append(p)
            if bucket_size is not None and offset - bucket_start >= bucket_size:
                offset = _round_up(offset, pad_multiple)
                spans.append((bucket_start, offset))
                bucket_start = offset
                groups.append([])
        if groups[-1]:
            offset = _round_up(offset, pad_multiple)
            spans.append((bucket_start, offset))
        else:
            groups.pop()
        return groups, spans

    def _attach_views(self) -> None:
        for p in self.params:
            r = self.index[id(p)]
            if self.param_data is not None:
                view = self.param_data[r.start : r.end].view(p.shape)
                view.copy_(p.data)
                p.data = view  # the model now reads its weights from the flat buffer
            p.main_grad = self.grad_data[r.start : r.end].view(p.shape)  # type: ignore[attr-defined]

    def reset(self) -> None:
        """Zero the gradients (padding included) and the buckets' readiness state."""
        self.grad_data.zero_()
        for b in self.buckets:
            b.ready_count.clear()
            b.launched = False

    def nbytes(self) -> dict[str, int]:
        """Bytes held by this buffer's grad and (if any) param storage."""
        grad = self.grad_data.numel() * self.grad_data.element_size()
        param = 0 if self.param_data is None else self.param_data.numel() * self.param_data.element_size()
        return {"grad": grad, "param": param}


def register_grad_accumulation_hooks(
    params: Sequence[nn.Parameter], on_accumulated: Callable[[nn.Parameter], None]
) -> list[Any]:
    """After autograd accumulates ``param.grad``: ``main_grad += grad``; free ``grad``; notify.

    The addition promotes to ``main_grad``'s dtype (fp32 when gradients are reduced in fp32), so
    bf16/fp16 per-microbatch gradients accumulate in fp32. Returns the hook handles.
    """

    def make_hook(param: nn.Parameter) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if p.grad is None:
                return
            p.main_grad.add_(p.grad)  # type: ignore[attr-defined]
            p.grad = None
            on_accumulated(param)

        return hook

    return [p.register_post_accumulate_grad_hook(make_hook(p)) for p in params]
