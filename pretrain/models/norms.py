"""Normalization layers: LayerNorm (GPT-2, BERT) and RMSNorm (Llama family), chosen by config."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config import ModelConfig
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.mappings import ProcessGroup, copy_to_tp_region

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
    ) -> None:
        super().__init__()
        self.eps = eps
        self.grad_group = grad_group
        self.weight = nn.Parameter(torch.empty(size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return _shared(self.weight, self.grad_group) * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def _shared(w: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return w if group is None else copy_to_tp_region(w, group)


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
        return RMSNorm(size, eps=cfg.layernorm_epsilon, device=ps.device, dtype=dtype, grad_group=group)
    if group is not None:
        return HeadLayerNorm(size, eps=cfg.layernorm_epsilon, grad_group=group, device=ps.device, dtype=dtype)
    return nn.LayerNorm(size, eps=cfg.layernorm_epsilon, device=ps.device, dtype=dtype)
