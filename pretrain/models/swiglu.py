"""SwiGLU ``silu(gate) * up`` on a fused ``[..., 2 f]`` input that keeps only that input for backward.

Plain autograd keeps ``gate``/``up`` (a view of the fused input) *and* ``silu(gate)`` ``[..., f]``
for the product's backward; :func:`swiglu` recomputes ``silu(gate)`` in backward instead (as
megatron-core's fused SwiGLU does), saving ``[..., f]`` per layer. ``keep_silu=True`` keeps it
(one ``silu`` pass less per backward) where activation memory is cheap: a frozen fc1 (LoRA or
frozen fine-tuning) holds no base weight gradient or optimizer state. Backward runs the same
kernels autograd would (``mul``, ``silu_backward``; the split's ``cat`` becomes writes into one
``[..., 2 f]`` tensor, and the temporaries are written in place there), so values and gradients
are bitwise those of ``F.silu(gate) * up`` either way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from pretrain.models import fused_kernels


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, keep_silu: bool, fused: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.fused = fused
        if fused:  # one compiled loop each way; only y is kept
            ctx.save_for_backward(y, None)
            return fused_kernels.swiglu_forward(y)  # type: ignore[no-any-return]
        gate, up = y.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(y, act if keep_silu else None)
        return act * up

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        y, act = ctx.saved_tensors
        if ctx.fused:
            return fused_kernels.swiglu_backward(grad, y), None, None
        gate, up = y.chunk(2, dim=-1)
        out = torch.empty_like(y)
        grad_gate, grad_up = out.chunk(2, dim=-1)
        # elementwise kernels: each output element reads only its own inputs, so out= may alias one
        if act is None:  # recompute silu(gate) where the gradient of up goes
            act = torch.ops.aten.silu.out(gate, out=grad_up)
        torch.mul(act, grad, out=grad_up)
        torch.mul(grad, up, out=grad_gate)
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return out, None, None


def swiglu(y: torch.Tensor, *, keep_silu: bool = False, fused: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` for ``y = [gate, up]`` ``[..., 2 f]`` -> ``[..., f]``; under autograd
    only ``y`` is kept for backward, and ``silu(gate)`` ``[..., f]`` too with ``keep_silu``.
    ``fused``: forward and backward as compiled loops (:mod:`pretrain.models.fused_kernels`; only
    ``y`` kept)."""
    if not (torch.is_grad_enabled() and y.requires_grad):
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    return _SwiGLU.apply(y, keep_silu, fused)  # type: ignore[no-any-return]
