"""The router's training losses, with megatron-core's formulas and gradient scaling.

* **Load-balancing (auxiliary) loss** (``--moe-router-load-balancing-type aux_loss``,
  ``--moe-aux-loss-coeff c``; Switch Transformer): with router scores ``P`` (softmax over all
  experts, or normalised sigmoid), ``f_i`` the number of tokens whose top-k (of those scores)
  holds expert i, ``T`` tokens, ``E`` experts: ``loss = c E / (k T^2) * sum_i f_i * sum_t P_ti``.
* **z-loss** (``--moe-z-loss-coeff c``; ST-MoE): ``c * mean_t(logsumexp(logits_t)^2)``.

Both are computed per microbatch on the router logits and are not added to the language-model
loss: as megatron-core's ``MoEAuxLossAutoScaler`` does, their gradient is injected in the backward
pass at the router, scaled like the main loss (``1 / (microbatches x DP)`` times the fp16 loss
scale; our main loss is a token sum over the global batch, reduced by DP *sum*). So they work on any
pipeline stage. Every TP rank holds all tokens and the same logits, so each computes the whole loss
and the same router gradient (no collective).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def aux_scores(logits: torch.Tensor, *, topk: int, score_function: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``[T, E]`` (fp32) and routing map ``[T, E]`` (bool, top-k of the scores) for the
    load-balancing loss (megatron-core's ``compute_routing_scores_for_aux_loss``)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top = torch.topk(scores, k=topk, dim=-1).indices
    return scores, torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)


def load_balancing_loss(
    logits: torch.Tensor, *, topk: int, score_function: str, coeff: float
) -> torch.Tensor:
    """``c E / (k T^2) * sum_i f_i * sum_t P_ti`` for router ``logits [T, E]`` (a scalar)."""
    scores, routed = aux_scores(logits, topk=topk, score_function=score_function)
    tokens, experts = logits.shape
    per_expert = routed.sum(dim=0).to(scores.dtype)
    return (scores.sum(dim=0) * per_expert).sum() * (experts * coeff / (topk * tokens * tokens))


def z_loss(logits: torch.Tensor, *, coeff: float) -> torch.Tensor:
    """``c * mean(logsumexp(logits)^2)`` over the ``T`` tokens of ``logits [T, E]``."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean() * coeff


class _InjectLossGrad(torch.autograd.Function):
    """Identity on ``x``; in backward, ``loss`` receives the gradient ``scale`` (not added to the
    model's output: megatron-core's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def attach_loss(x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged, with ``loss``'s gradient (``scale``) injected when ``x``'s is computed."""
    return _InjectLossGrad.apply(x, loss, scale)  # type: ignore[no-any-return]


@dataclass
class RouterStats:
    """Accumulated over the training forwards since the last :meth:`reset` (for logging):
    ``tokens_per_expert [E]`` (after any token dropping), the sums of the load-balancing loss and
    z-loss *divided by their coefficients* (as Megatron logs them) and the number of forwards."""

    tokens_per_expert: torch.Tensor
    load_balancing_loss: float = 0.0
    z_loss: float = 0.0
    forwards: int = 0
    dropped_tokens: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def reset(self) -> None:
        self.tokens_per_expert.zero_()
        self.load_balancing_loss = self.z_loss = 0.0
        self.forwards = self.dropped_tokens = 0
