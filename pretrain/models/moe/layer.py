"""The mixture-of-experts MLP of a layer (Megatron's ``MoELayer``), tensor-parallel.

Every TP rank of a group sees all tokens and holds the TP slice of each of its experts (or, with
ETP 1, whole experts for its share of the tokens); with expert parallelism it holds ``E / EP`` of
them and exchanges tokens with its EP group (:mod:`pretrain.models.moe.dispatch`). Either way the
routed and shared experts contribute *partial* outputs that one all-reduce over the TP group sums
(g), as in the dense MLP. The router runs on the replicated
input; its probabilities and the shared-expert gate enter the TP region through f, so their
gradients are summed over the TP group and every rank holds the same router gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pretrain.config import ModelConfig
from pretrain.models.moe.capacity import keep_mask
from pretrain.models.moe.dispatch import ExpertDispatcher
from pretrain.models.moe.experts import ExpertMLP, SharedExpertMLP
from pretrain.models.moe.losses import RouterStats, attach_loss, load_balancing_loss, z_loss
from pretrain.models.moe.router import Routing, TopKRouter
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.layers import mark_expert
from pretrain.tensor_parallel.mappings import copy_to_tp_region, reduce_from_tp_region


class MoEMLP(nn.Module):
    """``x [b, s, h]`` -> ``[b, s, h]``: each token goes to ``moe_router_topk`` of ``num_experts``
    experts, their outputs weighted by the router's probabilities and summed, plus the shared
    expert. Collectives over the TP group: f on the input, probabilities and gate (backward
    all-reduce), g on the summed output (forward all-reduce).

    Training adds the router losses' gradients (:mod:`pretrain.models.moe.losses`, scaled by
    ``aux_loss_scale``, which the schedule sets) and accumulates :class:`RouterStats` in
    ``stats``; ``tokens_per_expert`` (``[E]``, detached) holds the last forward's routing counts.
    """

    def __init__(self, cfg: ModelConfig, ps: ParallelState, *, layer_number: int = 0) -> None:
        super().__init__()
        self.cfg, self.layer_number = cfg, layer_number
        self.num_experts = int(cfg.num_experts or 0)
        self.topk = cfg.moe_router_topk
        self.group = ps.tp_group
        self.router = TopKRouter(cfg, ps)
        self.dispatcher = ExpertDispatcher(cfg, ps)
        self.experts = nn.ModuleList(  # this EP rank's experts, local index i = global first + i
            ExpertMLP(cfg, ps, cfg.moe_ffn_size, tp=ps.etp_size) for _ in range(self.dispatcher.num_local)
        )
        for p in self.experts.parameters():
            mark_expert(p)
        if cfg.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(cfg, ps)
        self.tokens_per_expert: torch.Tensor | None = None
        self.aux_loss_scale = 1.0
        self.stats = RouterStats(tokens_per_expert=torch.zeros(self.num_experts, dtype=torch.int64))

    def _routed(self, x: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Partial routed output ``[T, h]``: tokens grouped by expert (stable, so each expert sees
        its tokens in order), each group through its expert (here or on an EP peer), weighted,
        scattered back by sum. Slots with ``experts == E`` (dropped past capacity) are skipped."""
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts + 1)
        self.tokens_per_expert = counts[: self.num_experts].detach()
        return self.dispatcher(x, experts, probs, self.experts)

    def _route(self, flat: torch.Tensor) -> Routing:
        """Route ``flat [T, h]``; drop past capacity; in training attach the router losses."""
        routing = self.router(flat)
        probs, experts = routing.probs, routing.experts
        cfg = self.cfg
        if cfg.moe_expert_capacity_factor is not None:
            keep = keep_mask(probs, experts, num_experts=self.num_experts, factor=cfg.moe_expert_capacity_factor,
                             policy=cfg.moe_token_drop_policy)  # fmt: skip
            probs = probs * keep
            experts = torch.where(keep, experts, self.num_experts)
            if self.training:
                self.stats.dropped_tokens += int((~keep).sum())
        if self.training and torch.is_grad_enabled():
            probs = self._attach_losses(routing.logits, probs)
        return Routing(probs=probs, experts=experts, logits=routing.logits)

    def _attach_losses(self, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        cfg, stats = self.cfg, self.stats
        stats.forwards += 1
        if cfg.moe_router_load_balancing_type == "aux_loss" and cfg.moe_aux_loss_coeff > 0:
            aux = load_balancing_loss(logits, topk=self.topk, score_function=cfg.moe_router_score_function,
                                      coeff=cfg.moe_aux_loss_coeff)  # fmt: skip
            stats.load_balancing_loss += float(aux.detach()) / cfg.moe_aux_loss_coeff
            probs = attach_loss(probs, aux, self.aux_loss_scale)
        if cfg.moe_z_loss_coeff:
            z = z_loss(logits, coeff=cfg.moe_z_loss_coeff)
            stats.z_loss += float(z.detach()) / cfg.moe_z_loss_coeff
            probs = attach_loss(probs, z, self.aux_loss_scale)
        return probs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self._route(flat)
        x_tp = copy_to_tp_region(flat, self.group)
        out = self._routed(x_tp, routing.experts, copy_to_tp_region(routing.probs, self.group))
        if self.training and self.tokens_per_expert is not None:
            self.stats.tokens_per_expert += self.tokens_per_expert.cpu()
        if hasattr(self, "shared_experts"):
            shared = self.shared_experts(x_tp)
            gate = self.shared_experts.gate(flat)
            out = out + (shared if gate is None else shared * copy_to_tp_region(gate, self.group))
        return reduce_from_tp_region(out, self.group).view(shape)


def set_aux_loss_scale(chunks: Sequence[nn.Module], scale: float) -> None:
    """Set the gradient scale of every MoE layer's router losses in ``chunks`` (the schedule calls
    this before each training step: the fp16 loss scale / (microbatches x DP))."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoEMLP):
                module.aux_loss_scale = scale
