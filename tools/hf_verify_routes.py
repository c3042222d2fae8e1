"""``to-hf --verify`` for mixture-of-experts models: each MoE layer's router choices (the top-k
expert indices of every probe token) of the export, run by ``transformers``, equal ours.

Logits alone can hide a routing fault that barely moves them (a router row swapped with a nearly
identical one); the top-k indices cannot. :func:`record_routes` records every router call of both
models during the verification's forwards through a global forward hook (so neither model has to
be reached into): ours are :class:`~pretrain.models.moe.router.TopKRouter` (``Routing.experts``),
theirs any module whose class name ends in ``TopKRouter`` (transformers 5's Mixtral, Qwen2-MoE,
Qwen3-MoE and OLMoE routers return ``(logits, weights, indices)``). Calls are matched in order:
both models visit their MoE layers in layer order.

A token counts as rerouted only when transformers' own logits separate its k-th and (k+1)-th
expert by more than the tolerance (a near tie may fall either way in float32).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pretrain.models.moe.router import Routing, TopKRouter
from pretrain.utils.errors import UserError


@dataclasses.dataclass
class Routes:
    """Recorded router calls: ours ``[T, k]`` expert indices, theirs ``(indices [T, k], logits [T, E])``."""

    ours: list[torch.Tensor] = dataclasses.field(default_factory=list)
    theirs: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)

    def hook(self, module: nn.Module, _args: Any, output: Any) -> None:
        if isinstance(module, TopKRouter) and isinstance(output, Routing):
            self.ours.append(output.experts.detach().clone())
        elif type(module).__name__.endswith("TopKRouter") and isinstance(output, tuple) and len(output) == 3:
            logits, _weights, indices = output
            self.theirs.append((indices.detach().clone(), logits.detach().float().clone()))

    def check(self, tolerance: float) -> int:
        """The number of MoE layers compared; :class:`UserError` naming the first layer whose
        choices differ (or when the two models routed a different number of times)."""
        if len(self.ours) != len(self.theirs):
            raise UserError(
                f"to-hf verify: the checkpoint routed {len(self.ours)} times, the export {len(self.theirs)} "
                "(MoE layers differ)"
            )
        for layer, (ours, (theirs, logits)) in enumerate(zip(self.ours, self.theirs, strict=True)):
            _check_layer(layer, ours, theirs, logits, tolerance)
        return len(self.ours)


def _check_layer(layer: int, ours: torch.Tensor, theirs: torch.Tensor, logits: torch.Tensor, tolerance: float) -> None:  # fmt: skip
    ours, theirs = ours.reshape(theirs.shape), theirs
    differ = (ours.sort(-1).values != theirs.sort(-1).values).any(-1)
    k = theirs.shape[-1]
    if k < logits.shape[-1]:
        top = logits.topk(k + 1, dim=-1).values
        clear = (top[:, k - 1] - top[:, k]) > tolerance * max(1.0, float(logits.abs().max()))
        differ &= clear
    if bool(differ.any()):
        t = int(differ.nonzero()[0, 0])
        raise UserError(
            f"to-hf verify: MoE layer {layer} (counting MoE layers) routes {int(differ.sum())} of "
            f"{differ.numel()} probe tokens to other experts than transformers (token {t}: checkpoint "
            f"{sorted(ours[t].tolist())}, export {sorted(theirs[t].tolist())})"
        )


@contextlib.contextmanager
def record_routes() -> Iterator[Routes]:
    """Record every router call of both models inside the block (see the module docstring)."""
    routes = Routes()
    handle = nn.modules.module.register_module_forward_hook(routes.hook)
    try:
        yield routes
    finally:
        handle.remove()
