"""SwiGLU ``silu(gate) * up`` on a fused ``[..., 2 f]`` input that keeps only that input for backward.

Plain autograd keeps ``gate``/``up`` (a view of the fused input) *and* ``silu(gate)`` ``[..., f]``
for the product's backward; :func:`swiglu` recomputes ``silu(gate)`` in backward instead (as
megatron-core's fused SwiGLU does), saving ``[..., f]`` per layer. Backward runs the same kernels
autograd would (``mul``, ``silu_backward``; the split's ``cat`` becomes writes into one
``[..., 2 f]`` tensor, and the temporaries are written in place there), so values and gradients
are bitwise those of ``F.silu(gate) * up``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        gate, up = y.chunk(2, dim=-1)
        ctx.save_for_backward(y)
        return F.silu(gate) * up

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        gate, up = y.chunk(2, dim=-1)
        out = torch.empty_like(y)
        grad_gate, grad_up = out.chunk(2, dim=-1)
        # elementwise kernels: each output element reads only its own inputs, so out= may alias one
        torch.mul(torch.ops.aten.silu.out(gate, out=grad_up), grad, out=grad_up)
        torch.mul(grad, up, out=grad_gate)
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return out


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``y = [gate, up]`` ``[..., 2 f]`` -> ``[..., f]``; under autograd
    only ``y`` is kept for backward."""
    if not (torch.is_grad_enabled() and y.requires_grad):
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    return _SwiGLU.apply(y)  # type: ignore[no-any-return]
