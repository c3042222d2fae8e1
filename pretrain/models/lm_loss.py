"""The output layer and the per-token cross entropy as one pass over row blocks (frozen head, one rank).

With a frozen output weight the only gradient the head passes on is the hidden states'. Per
token ``i`` that is ``dL_i/dx_i = (softmax(x_i W^T) - onehot(t_i)) W`` times the incoming
``grad_loss_i``, a per-row scalar that factors out of the sum over the vocabulary. So forward
computes, one block of rows at a time, the logits (into one reused ``[rows, V]`` buffer), their
log-softmax in place, the loss, and ``(softmax - onehot) W`` ``[rows, h]``; backward only scales
those rows by ``grad_loss``. The ``[n, V]`` logits and log-probabilities are never held whole,
nothing of size ``V`` is kept for backward, and the GEMMs are those of the plain path (the input
gradient GEMM just runs in forward). Values equal ``F.cross_entropy(F.linear(x, W), t,
reduction="none")`` and its input gradient up to fp32 rounding.

A bf16 or fp16 head (a LoRA run on a bf16 base) rounds as the plain path does (the logits GEMM in
its dtype, then ``.float()`` and the cross entropy in fp32; ``softmax - onehot`` rounded to its
dtype for the input gradient's GEMM), except that the per-row ``grad_loss`` scales the GEMM's
output instead of its input: the input gradient equals the plain path's up to one more rounding
to that dtype. Its ``[n, V]`` logits, their fp32 copy and the fp32 softmax the plain path keeps
for backward are never held whole either.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from pretrain.models.cpu_gemm import GemmLibrary, mm_weight, mm_weight_t, runs_onednn
from pretrain.tensor_parallel.cross_entropy import block_elements

_CPU_BLOCK_ELEMENTS = 1 << 23  # elements of the reused logits block on the CPU (32 MiB in fp32)


class _LMHeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, gemm: GemmLibrary
    ) -> torch.Tensor:
        n, v = x.shape[0], weight.shape[0]
        rows = max(1, min(n, block_elements(x.device, cpu=_CPU_BLOCK_ELEMENTS) // max(v, 1)))
        onednn = runs_onednn(gemm, x, weight)
        low = x.dtype != torch.float32  # a bf16/fp16 head: its GEMMs in that dtype, the softmax in fp32
        buf = None if onednn else x.new_empty(rows, v, dtype=torch.float32)  # oneDNN writes a new block
        low_buf = x.new_empty(rows, v) if low else None
        loss = x.new_empty(n, dtype=torch.float32)
        grad_x = x.new_empty(x.shape) if ctx.needs_input_grad[0] else None
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            t = target[start:stop].unsqueeze(-1)
            block = _logits(x[start:stop], weight, gemm, buf, low_buf)  # fp32 [stop - start, V]
            # row-wise kernel: each row is read whole before it is written, so out= may alias it
            torch.ops.aten._log_softmax.out(block, -1, False, out=block)
            torch.neg(block.gather(-1, t).squeeze(-1), out=loss[start:stop])
            if grad_x is not None:  # d loss_i / d logits_i = softmax - onehot, times W
                block.exp_().scatter_add_(-1, t, block.new_full(t.shape, -1.0))
                if low_buf is not None:  # rounded to the head's dtype, as the plain path's cast back
                    block = low_buf[: stop - start].copy_(block)
                    torch.mm(block, weight, out=grad_x[start:stop])
                elif buf is None:
                    grad_x[start:stop] = mm_weight(block, weight, gemm)
                else:
                    torch.mm(block, weight, out=grad_x[start:stop])
            del block  # freed before the next block is made
        ctx.save_for_backward(grad_x)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        (grad_x,) = ctx.saved_tensors
        # in place: kept only for this (a second backward is refused: the saved tensor changed)
        return grad_x.mul_(grad_loss.unsqueeze(-1)), None, None, None


def _logits(
    x: torch.Tensor, weight: torch.Tensor, gemm: GemmLibrary, buf: torch.Tensor | None, low_buf: torch.Tensor | None
) -> torch.Tensor:  # fmt: skip
    """The fp32 logits ``[rows, V]`` of ``x [rows, h]``: in ``buf`` (reused) or new (oneDNN, fp32
    only); a bf16/fp16 head's GEMM rounds them to its dtype first (in ``low_buf``), as the plain path's."""
    rows = x.shape[0]
    if low_buf is not None and buf is not None:
        return buf[:rows].copy_(torch.mm(x, weight.t(), out=low_buf[:rows]))
    if buf is None:
        return mm_weight_t(x, weight, gemm)
    return torch.mm(x, weight.t(), out=buf[:rows])


def lm_head_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, gemm: GemmLibrary = "mkl"
) -> torch.Tensor:
    """Per-token loss ``[...]`` of ``hidden [..., h]`` under the output weight ``weight [V, h]``
    (every row a real vocabulary entry) for targets ``target [...]`` in ``[0, V)``: float32, as
    the plain path. Only the hidden states get a gradient, in their dtype (the caller keeps this
    to a frozen ``weight`` of the hidden states' dtype and one tensor-parallel rank). ``gemm``: the library of its two GEMMs
    on the CPU (:mod:`pretrain.models.cpu_gemm`)."""
    loss = _LMHeadCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), gemm)
    return loss.view(target.shape)  # type: ignore[no-any-return]


def fused_loss_ok(hidden: torch.Tensor, weight: torch.Tensor, tp_size: int) -> bool:
    """Whether :func:`lm_head_cross_entropy` computes the loss: one tensor-parallel rank, a frozen
    output weight, and hidden states and weight both fp32, or both bf16/fp16 on the CPU (on a GPU a
    16-bit head keeps the plain path, where this one is not yet measured)."""
    if tp_size != 1 or weight.requires_grad or hidden.dtype != weight.dtype:
        return False
    low = hidden.dtype in (torch.bfloat16, torch.float16) and hidden.device.type == "cpu"
    return hidden.dtype == torch.float32 or low
