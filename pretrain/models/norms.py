"""Normalization layers: LayerNorm (GPT-2, BERT) and RMSNorm (Llama family), chosen by config."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from pretrain.config import ModelConfig
from pretrain.models import fused_kernels
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.layers import mark_partition
from pretrain.tensor_parallel.mappings import (
    ProcessGroup,
    copy_to_tp_region,
    group_size,
    reduce_from_tp_region,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, computed in float32.

    As Megatron's and Hugging Face's Llama RMSNorm: the statistics in float32, the normalized
    input cast back to the input dtype before the (learned, no bias) scale.
    """

    def __init__(
        self,
        size: int,
        *,
        eps: float,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        grad_group: ProcessGroup | None = None,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.grad_group = grad_group
        self.fused = fused  # run pretrain.models.fused_kernels' loops (not per-head norms under TP)
        self.weight = nn.Parameter(torch.empty(size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frozen = not self.weight.requires_grad and self.grad_group is None
        if (
            frozen
            and x.requires_grad
            and x.dtype == self.weight.dtype == torch.float32
            and torch.is_grad_enabled()
        ):
            return _FrozenRMSNorm.apply(x, self.weight, self.eps, self.fused)  # type: ignore[no-any-return]
        if self.fused and self.weight.requires_grad and self.grad_group is None and torch.is_grad_enabled():
            return _TrainedRMSNorm.apply(x, self.weight, self.eps)  # type: ignore[no-any-return]
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return _shared(self.weight, self.grad_group) * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class _FrozenRMSNorm(torch.autograd.Function):
    """:class:`RMSNorm` of fp32 ``x [..., h]`` with a frozen ``weight [h]``: the forward ops of the
    plain path (same values), and the input gradient in five passes over ``[..., h]``,
    ``r (w g) - x r^3 mean(w g x)`` with ``r = rsqrt(mean(x^2) + eps)``, where autograd through the
    plain ops takes about eight (mean's and pow's backward each materialize a full tensor).
    ``fused``: the same formulas as one compiled loop each (:mod:`pretrain.models.fused_kernels`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.fused = fused
        if fused:
            y, rstd = fused_kernels.rms_norm_forward(x, weight, eps)
        else:
            rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            y = torch.mul(x, rstd).mul_(weight)  # weight * (x * rstd), one [..., h] tensor less
        ctx.save_for_backward(x, weight, rstd)
        return y  # type: ignore[no-any-return]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        if ctx.fused:
            return fused_kernels.rms_norm_backward(g, x, weight, rstd), None, None, None
        gw = g * weight
        coef = (gw * x).sum(-1, keepdim=True) * rstd.pow(3) / x.shape[-1]
        return gw.mul_(rstd).addcmul_(x, coef, value=-1.0), None, None, None


class _TrainedRMSNorm(torch.autograd.Function):
    """:class:`RMSNorm` of ``x [..., h]`` with a trained ``weight [h]`` (``--fused-kernels``): the plain
    path's formulas (statistics in float32, the normalized input cast to ``x``'s dtype before the
    scale) as one compiled loop forward and one backward, which also sums the weight's gradient.
    Eager autograd runs about seven kernels forward and ten backward over ``[..., h]``, keeping a
    float32 copy of ``x``; this keeps ``x`` and ``rstd [..., 1]``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        y, rstd = fused_kernels.rms_norm_train_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y  # type: ignore[no-any-return]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, None]:  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = fused_kernels.rms_norm_train_backward(g.contiguous(), x, weight, rstd)
        return (grad_x if ctx.needs_input_grad[0] else None), grad_weight, None


def _shared(w: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return w if group is None else copy_to_tp_region(w, group)


class FullWidthRMSNorm(nn.Module):
    """RMSNorm over a whole projection of ``width`` channels split along its last dimension over the
    TP group (OLMoE's query/key norm over ``[nq d]`` / ``[g d]``, not per head).

    Input ``[..., width / tp]`` (this rank's heads, in the projection's order); ``weight``
    ``[width / tp]``, sharded with the heads (partition dim 0). The mean of squares is over the
    full width: each rank's sum of squares is all-reduced over ``group`` (forward and backward:
    every rank's output depends on every rank's input).
    """

    def __init__(self, width: int, *, eps: float, group: ProcessGroup | None, tp: int = 1,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:  # fmt: skip
        super().__init__()
        self.eps, self.width, self.group = eps, width, group
        local = width // tp  # tp, not the group's size: checkpoint plans build models without groups
        self.weight = mark_partition(nn.Parameter(torch.empty(local, device=device, dtype=dtype)), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        squares = h.pow(2).sum(-1, keepdim=True)
        if group_size(self.group) > 1:  # sum over ranks, gradient summed back (g then f)
            squares = copy_to_tp_region(reduce_from_tp_region(squares, self.group), self.group)
        h = h * torch.rsqrt(squares / self.width + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)} of {self.width}, eps={self.eps}"


class HeadLayerNorm(nn.LayerNorm):
    """A LayerNorm whose replicated parameters see only this rank's part of the input (QK-norm over
    the local heads): their gradient is all-reduced over ``grad_group`` (f on the parameters)."""

    def __init__(self, size: int, *, eps: float, grad_group: ProcessGroup | None, **kw: object) -> None:
        super().__init__(size, eps=eps, **kw)  # type: ignore[arg-type]
        self.grad_group = grad_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.grad_group
        return F.layer_norm(
            x, self.normalized_shape, _shared(self.weight, g), _shared(self.bias, g), self.eps
        )


def layer_norm(
    cfg: ModelConfig, ps: ParallelState, size: int | None = None, *, per_head: bool = False
) -> nn.Module:
    """The config's normalization (``cfg.normalization``) over ``size`` (default ``hidden_size``).

    Replicated on all TP ranks. On hidden states its gradients are identical on every TP rank;
    ``per_head`` norms (QK-norm) see only the local heads, so their gradients are summed over the
    TP group in backward (one small all-reduce per norm).
    """
    size = cfg.hidden_size if size is None else size
    dtype = DTYPES[cfg.params_dtype]
    group = ps.tp_group if per_head and ps.tp_size > 1 else None
    if cfg.normalization == "RMSNorm":
        return RMSNorm(size, eps=cfg.layernorm_epsilon, device=ps.device, dtype=dtype, grad_group=group,
                       fused=cfg.fused_kernels)  # fmt: skip
    if group is not None:
        return HeadLayerNorm(size, eps=cfg.layernorm_epsilon, grad_group=group, device=ps.device, dtype=dtype)
    return nn.LayerNorm(size, eps=cfg.layernorm_epsilon, device=ps.device, dtype=dtype)


def full_width_norm(cfg: ModelConfig, ps: ParallelState, width: int) -> FullWidthRMSNorm:
    """OLMoE's query or key norm (``cfg.qk_layernorm_full_width``) over a projection of ``width``
    channels, this rank's ``width / tp`` of it (see :class:`FullWidthRMSNorm`)."""
    group = ps.tp_group if ps.tp_size > 1 else None
    dtype = DTYPES[cfg.params_dtype]
    return FullWidthRMSNorm(width, eps=cfg.layernorm_epsilon, group=group, tp=ps.tp_size, device=ps.device,
                            dtype=dtype)  # fmt: skip
