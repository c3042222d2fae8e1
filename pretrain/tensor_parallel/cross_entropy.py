"""Vocab-parallel cross-entropy: each rank holds logits ``[..., V/t]`` for its vocabulary range.

Only per-token scalars cross the TP group: the running max (all-reduce MAX), the target logit
(all-reduce SUM; exactly one rank holds it) and the sum of exponentials (all-reduce SUM). The
``b * s * V`` logits are never gathered. Padded vocabulary columns must either be absent (the
model computes logits only for real rows) or ``-inf`` (:func:`mask_padded_vocab`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from pretrain.tensor_parallel.mappings import ProcessGroup, group_size


def _reduce(x: torch.Tensor, group: ProcessGroup | None, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def mask_padded_vocab(logits: torch.Tensor, *, vocab_start: int, true_vocab: int) -> torch.Tensor:
    """Set logits of padded vocabulary rows (global id >= ``true_vocab``) to ``-inf``.

    ``logits``: ``[..., V/t]`` of this rank, whose first column is global id ``vocab_start``.
    Returns ``logits`` itself when this rank holds no padding.
    """
    first_pad = true_vocab - vocab_start
    if first_pad >= logits.shape[-1]:
        return logits
    keep = torch.arange(logits.shape[-1], device=logits.device) < first_pad
    return logits.masked_fill(~keep, float("-inf"))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: ProcessGroup | None
    ) -> torch.Tensor:
        if logits.shape[-1] == 0:  # a TP rank holding only vocabulary padding
            logits_max = logits.new_full(target.shape, float("-inf"))
        else:
            logits_max = logits.max(dim=-1).values
        logits_max = _reduce(logits_max, group, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        local_v = logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_start + local_v)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        if local_v == 0:
            target_logit = torch.zeros_like(logits_max)
        else:
            target_logit = (
                shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
            )
        target_logit = _reduce(target_logit, group)
        exp = shifted.exp_()
        sum_exp = _reduce(exp.sum(dim=-1), group)
        loss = sum_exp.log() - target_logit
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax.clone()
        if grad.shape[-1] > 0:
            onehot = (~outside).to(grad.dtype).unsqueeze(-1)
            grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


class _CrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(logits, target, reduction="none")`` for ``logits [n, V]``, ``target [n]``,
    whose backward writes the gradient over the saved log-softmax instead of allocating two more
    ``[n, V]`` tensors (PyTorch's nll and log-softmax backward each allocate one). The kernels
    are PyTorch's own (log-softmax, its backward on row blocks), so loss and gradient are bitwise
    those of ``F.cross_entropy``. The saved tensor is consumed: a second backward through the same
    graph is refused by autograd (its version changed) rather than computed wrong."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        log_probs = F.log_softmax(logits, dim=-1)
        ctx.save_for_backward(log_probs, target)
        return log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1).neg()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        log_probs, target = ctx.saved_tensors
        n, v = log_probs.shape
        rows = max(1, min(n, block_elements(log_probs.device) // max(v, 1)))
        grad_lp = log_probs.new_empty(rows, v)  # the nll gradient of one row block: -grad at the target
        for start in range(0, n, rows):
            block = log_probs[start : start + rows]
            g = grad_lp[: block.shape[0]].zero_()
            g.scatter_(
                -1,
                target[start : start + rows].unsqueeze(-1),
                grad_loss[start : start + rows].neg().unsqueeze(-1),
            )
            # row-wise kernel: each element reads its own log-prob before writing it, so out= may alias it
            torch.ops.aten._log_softmax_backward_data.out(g, block, -1, block.dtype, out=block)
        return log_probs, None


def block_elements(device: torch.device, *, cpu: int = 1 << 21) -> int:
    """Elements of a reused row-block buffer on ``device``: ``cpu`` on the CPU (a few MiB, near the
    caches), 1 << 27 (512 MiB in fp32) on an accelerator, where each block costs kernel launches
    and small blocks leave the memory bandwidth idle (a 16-row block of a 128k vocabulary ran the
    log-softmax backward at a tenth of an H200's bandwidth, launch-bound)."""
    return cpu if device.type == "cpu" else 1 << 27


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, vocab_start: int, group: ProcessGroup | None
) -> torch.Tensor:
    """Per-token loss ``[...]`` from vocab-parallel logits ``[..., V/t]`` and global targets ``[...]``.

    Computed in float32 whatever the logits' dtype. Collectives over ``group``: three all-reduces
    of ``[...]``-shaped scalars per call; backward needs none.
    """
    if group_size(group) == 1 and logits.shape[-1] > 0:
        # One rank holds the whole vocabulary: PyTorch's fused cross-entropy is the same function.
        # Out-of-range targets (e.g. BERT's -1 at unmasked positions) get the loss of class 0;
        # callers mask them out, as they do for the parallel path's value there.
        flat = logits.float().reshape(-1, logits.shape[-1])
        tgt = target - vocab_start
        safe = tgt.masked_fill((tgt < 0) | (tgt >= logits.shape[-1]), 0).reshape(-1)
        return _CrossEntropy.apply(flat, safe).view(target.shape)  # type: ignore[no-any-return]
    return _VocabParallelCrossEntropy.apply(logits.float(), target, vocab_start, group)


def masked_mean(losses: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of per-token losses over positions where ``loss_mask`` is 1 (all when ``None``)."""
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp_min(1.0)
