"""Per-layer router statistics of a mixture-of-experts run, for the training log.

Every MoE layer accumulates :class:`~pretrain.models.moe.losses.RouterStats` over its training
forwards; :func:`collect_router_stats` sums them over all ranks (the TP ranks of a group hold the
same tokens, so only TP rank 0 contributes; DP ranks hold different tokens and add up) and resets
them. Collective: one all-reduce (SUM) of a ``[num_layers, E + 4]`` tensor over the world.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pretrain.config import ModelConfig
from pretrain.models.moe.layer import MoEMLP
from pretrain.parallel.state import ParallelState


@dataclass(frozen=True)
class RouterLog:
    """One logging interval: ``tokens_per_expert`` per global MoE layer (routed, after dropping),
    the load-balancing loss and z-loss (divided by their coefficients, as Megatron logs them)
    averaged over MoE layers and forwards, and the routed slots dropped past capacity."""

    tokens_per_expert: dict[int, list[int]]
    load_balancing_loss: float
    z_loss: float
    dropped_tokens: int

    def record(self) -> dict[str, object]:
        """The JSON-log fields."""
        return {
            "load_balancing_loss": self.load_balancing_loss,
            "z_loss": self.z_loss,
            "dropped_tokens": self.dropped_tokens,
            "tokens_per_expert": {str(k): v for k, v in self.tokens_per_expert.items()},
        }


def collect_router_stats(
    chunks: Sequence[nn.Module], cfg: ModelConfig, ps: ParallelState
) -> RouterLog | None:
    """Sum and reset every MoE layer's statistics over all ranks (None for a dense model)."""
    if cfg.num_experts is None:
        return None
    experts = int(cfg.num_experts)
    table = torch.zeros(cfg.num_layers, experts + 4, dtype=torch.float64)
    for chunk in chunks:
        for module in chunk.modules():
            if not isinstance(module, MoEMLP):
                continue
            s = module.stats
            if ps.tp_rank == 0:
                row = table[module.layer_number]
                row[:experts] += s.tokens_per_expert.to(torch.float64)
                row[experts:] += torch.tensor([s.load_balancing_loss, s.z_loss, s.forwards, s.dropped_tokens],
                                              dtype=torch.float64)  # fmt: skip
            s.reset()
    if dist.is_initialized() and dist.get_world_size() > 1:
        table = table.to(ps.device)
        dist.all_reduce(table)
        table = table.cpu()
    layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    forwards = max(float(table[layers, experts + 2].sum()), 1.0)
    return RouterLog(
        tokens_per_expert={i: [int(v) for v in table[i, :experts]] for i in layers},
        load_balancing_loss=float(table[layers, experts].sum()) / forwards,
        z_loss=float(table[layers, experts + 1].sum()) / forwards,
        dropped_tokens=int(table[layers, experts + 3].sum()),
    )
