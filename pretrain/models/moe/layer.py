"""The mixture-of-experts MLP of a layer (Megatron's ``MoELayer``), tensor-parallel.

Every TP rank of a group sees all tokens (no expert parallelism yet) and holds the TP slice of
every expert (expert-TP = TP), so the routed and shared experts contribute *partial* outputs that
one all-reduce over the TP group sums (g), as in the dense MLP. The router runs on the replicated
input; its probabilities and the shared-expert gate enter the TP region through f, so their
gradients are summed over the TP group and every rank holds the same router gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from pretrain.config import ModelConfig
from pretrain.models.moe.experts import ExpertMLP, SharedExpertMLP
from pretrain.models.moe.router import TopKRouter
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.mappings import copy_to_tp_region, reduce_from_tp_region


class MoEMLP(nn.Module):
    """``x [b, s, h]`` -> ``[b, s, h]``: each token goes to ``moe_router_topk`` of ``num_experts``
    experts, their outputs weighted by the router's probabilities and summed, plus the shared
    expert. Collectives over the TP group: f on the input, probabilities and gate (backward
    all-reduce), g on the summed output (forward all-reduce).

    ``tokens_per_expert`` (``[E]`` int64, detached) holds the last forward's routing counts.
    """

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        self.num_experts = int(cfg.num_experts or 0)
        self.topk = cfg.moe_router_topk
        self.group = ps.tp_group
        self.router = TopKRouter(cfg, ps)
        self.experts = nn.ModuleList(ExpertMLP(cfg, ps, cfg.moe_ffn_size) for _ in range(self.num_experts))
        if cfg.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(cfg, ps)
        self.tokens_per_expert: torch.Tensor | None = None

    def _routed(self, x: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Partial routed output ``[T, h]``: tokens grouped by expert (stable, so each expert sees
        its tokens in order), each group through its expert, weighted, scattered back by sum."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // self.topk
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.tokens_per_expert = counts.detach()
        pieces = x[token].split(counts.tolist())
        y = torch.cat([expert(p) for expert, p in zip(self.experts, pieces, strict=True)])
        y = y * probs.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(flat)
        x_tp = copy_to_tp_region(flat, self.group)
        out = self._routed(x_tp, routing.experts, copy_to_tp_region(routing.probs, self.group))
        if hasattr(self, "shared_experts"):
            shared = self.shared_experts(x_tp)
            gate = self.shared_experts.gate(flat)
            out = out + (shared if gate is None else shared * copy_to_tp_region(gate, self.group))
        return reduce_from_tp_region(out, self.group).view(shape)
