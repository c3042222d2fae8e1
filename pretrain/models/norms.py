"""Normalization layers: LayerNorm (GPT-2, BERT) and RMSNorm (Llama family), chosen by config."""

from __future__ import annotations

import torch
from torch import nn

from pretrain.config import ModelConfig
from pretrain.parallel.state import ParallelState

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, computed in float32.

    As Megatron's and Hugging Face's Llama RMSNorm: the statistics in float32, the normalized
    input cast back to the input dtype before the (learned, no bias) scale.
    """

    def __init__(
        self, size: int, *, eps: float, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def layer_norm(cfg: ModelConfig, ps: ParallelState, size: int | None = None) -> nn.Module:
    """The config's normalization (``cfg.normalization``) over ``size`` (default ``hidden_size``).

    Replicated on all TP ranks (its gradients are identical on every TP rank).
    """
    size = cfg.hidden_size if size is None else size
    dtype = DTYPES[cfg.params_dtype]
    if cfg.normalization == "RMSNorm":
        return RMSNorm(size, eps=cfg.layernorm_epsilon, device=ps.device, dtype=dtype)
    return nn.LayerNorm(size, eps=cfg.layernorm_epsilon, device=ps.device, dtype=dtype)
