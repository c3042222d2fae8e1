"""The top-k router of a mixture-of-experts layer, with megatron-core's scoring semantics.

Megatron's ``--moe-router-score-function softmax`` without ``--moe-router-pre-softmax`` takes the
top-k *logits* and softmaxes over those k: the probabilities of the chosen experts sum to one. That
equals renormalising the top-k of a full softmax (Hugging Face's ``norm_topk_prob=True``: Mixtral,
Qwen3-MoE). With ``--moe-router-pre-softmax`` the softmax runs over all experts before the top-k and
the chosen probabilities are kept as they are (``norm_topk_prob=False``: Qwen2-MoE, OLMoE).
``sigmoid`` scores each expert independently and renormalises the top k (k > 1).
``tests/test_moe_router.py`` checks this against megatron-core's ``topk_routing_with_score_function``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config import ModelConfig
from pretrain.models.norms import DTYPES
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.layers import mark_partition
from pretrain.utils.errors import UserError
from pretrain.utils.shape_probe import has_values


@dataclass(frozen=True)
class Routing:
    """The router's decision for ``T`` tokens.

    ``probs [T, k]``: weight of each chosen expert; ``experts [T, k]`` (int64): which experts;
    ``logits [T, E]``: the raw router logits (for the z-loss and the auxiliary loss).
    """

    probs: torch.Tensor
    experts: torch.Tensor
    logits: torch.Tensor


def route(
    logits: torch.Tensor,
    *,
    topk: int,
    pre_softmax: bool,
    score_function: str,
    scaling_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``logits [T, E]``: ``(probs [T, k], experts [T, k])``, Megatron's rules
    (see the module docstring). Scores are computed in fp32 and returned in the logits' dtype."""
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, experts = torch.topk(scores, k=topk, dim=-1)
        else:
            top_logits, experts = torch.topk(logits, k=topk, dim=-1)
            probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        probs, experts = torch.topk(scores, k=topk, dim=-1)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"unknown router score function {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    return probs, experts


class TopKRouter(nn.Module):
    """``weight [E, h]`` (replicated on TP ranks, as Megatron's ``mlp.router.weight``).

    Input ``[T, h]``, identical on the TP ranks of a group; no collective here (the caller makes
    the probabilities' gradient whole across TP, see :class:`~pretrain.models.moe.layer.MoEMLP`).
    """

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        experts = int(cfg.num_experts or 0)
        kw: dict[str, Any] = {"device": ps.device, "dtype": DTYPES[cfg.params_dtype]}
        self.weight = mark_partition(nn.Parameter(torch.empty(experts, cfg.hidden_size, **kw)), None)
        self.topk = cfg.moe_router_topk
        self.pre_softmax = cfg.moe_router_pre_softmax
        self.score_function = cfg.moe_router_score_function
        self.scaling_factor = cfg.moe_router_topk_scaling_factor

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, self.weight)
        probs, experts = route(
            logits,
            topk=self.topk,
            pre_softmax=self.pre_softmax,
            score_function=self.score_function,
            scaling_factor=self.scaling_factor,
        )
        return Routing(probs=probs, experts=experts, logits=logits)


def check_router_weight(name: str, weight: torch.Tensor) -> None:
    """Refuse an all-zero router weight ``[E, h]`` (``name`` says where): every token's top-k would
    be a tie, so it is a lost or never-written router (Megatron-Bridge #1883's zero export), never
    a model. Placeholders and shape probes (dry runs: :mod:`pretrain.utils.shape_probe`) are not
    checked."""
    if has_values(weight) and weight.numel() and not bool(weight.any()):
        raise UserError(
            f"{name} is all zeros: every token's top-k would be a tie (an untrained or lost router)"
        )
