"""Expert capacity with token dropping (``--moe-expert-capacity-factor``), as megatron-core's
``apply_router_token_dropping``: each expert takes at most
``ceil(T k / E * capacity_factor)`` of the ``T`` tokens of a microbatch; past that, the routed
slots with the lowest probabilities (``--moe-token-drop-policy probs``), or for ``position`` the
slots that ``torch.topk`` of the 0/1 routing map leaves out (megatron-core's rule, ties as it breaks
them), are dropped: their probability becomes 0 and the token skips that expert. Without a
capacity factor routing is dropless. (``--moe-pad-expert-input-to-capacity`` only pads the
expert inputs with zero-weight tokens: the same function.)
"""

from __future__ import annotations

import math

import torch


def expert_capacity(tokens: int, *, topk: int, experts: int, factor: float) -> int:
    """Megatron's ``get_capacity(T k, E, factor)``: ``ceil(T k / E * factor)``."""
    return math.ceil((tokens * topk / experts) * factor)


def keep_mask(
    probs: torch.Tensor, experts: torch.Tensor, *, num_experts: int, factor: float, policy: str
) -> torch.Tensor:
    """Bool ``[T, k]``: which routed slots (``probs``/``experts`` ``[T, k]``) fit their expert's
    capacity. With ``probs`` each expert keeps its highest-probability slots; with ``position``
    its earliest tokens."""
    tokens, topk = experts.shape
    capacity = expert_capacity(tokens, topk=topk, experts=num_experts, factor=factor)
    if capacity >= tokens:  # Megatron: no dropping when the capacity exceeds the token count
        return torch.ones_like(experts, dtype=torch.bool)
    if policy not in ("probs", "position"):
        raise ValueError(f"unknown token drop policy {policy!r}")
    dense = torch.zeros(tokens, num_experts, dtype=probs.dtype, device=probs.device)
    dense.scatter_(1, experts, probs.detach())
    # megatron-core's selection, ties included: top-`capacity` rows per expert column of the
    # probabilities, or of the 0/1 routing map for `position` (torch.topk, unsorted)
    score = dense if policy == "probs" else (dense > 0).int()
    kept = torch.topk(score, k=capacity, dim=0, sorted=False).indices
    room = torch.zeros(tokens, num_experts, dtype=torch.bool, device=probs.device).scatter(0, kept, True)
    return torch.gather(room & (dense > 0), 1, experts)
