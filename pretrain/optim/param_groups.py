"""Weight-decay parameter groups: no decay on biases and LayerNorm weights (paper, Megatron)."""

from __future__ import annotations

from torch import nn


def uses_weight_decay(name: str, param: nn.Parameter) -> bool:
    """False for biases and one-dimensional tensors (LayerNorm weights and biases)."""
    return not (name.endswith(".bias") or param.dim() == 1)


def split_by_weight_decay(
    named_params: list[tuple[str, nn.Parameter]],
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """``(decay, no_decay)`` lists, preserving order; frozen parameters are dropped."""
    decay = [(n, p) for n, p in named_params if p.requires_grad and uses_weight_decay(n, p)]
    no_decay = [(n, p) for n, p in named_params if p.requires_grad and not uses_weight_decay(n, p)]
    return decay, no_decay
