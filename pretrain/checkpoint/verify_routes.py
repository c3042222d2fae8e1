"""``--verify`` for mixture-of-experts models: each MoE layer's router choices (the top-k expert
indices of every probe token) agree between the two models a conversion compares -- the
checkpoint and transformers' model (``to-hf``, ``from-hf``) or the source and the new checkpoint
(``reshard``).

Logits alone can hide a routing fault that barely moves them (two experts with nearly identical
weights whose router rows are swapped); the top-k indices cannot. :func:`record_routes` records
every router call inside its block through a global forward hook (so no model has to be reached
into): ours are :class:`~pretrain.models.moe.router.TopKRouter` (``Routing.experts`` and
``Routing.logits``), transformers' any module whose class name ends in ``TopKRouter``
(transformers 5's Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE routers return ``(logits, weights,
indices)``). Calls are matched in order: every model visits its MoE layers in layer order.

A token counts as rerouted only when the reference's own router logits separate its k-th and
(k+1)-th expert by more than the tolerance (a near tie may fall either way in float32).
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

Choice = tuple[torch.Tensor, torch.Tensor]  # (expert indices [T, k], router logits [T, E])


@dataclasses.dataclass
class Routes:
    """Recorded router calls: ours ``[T, k]`` expert indices (with our logits ``[T, E]`` in
    ``ours_logits``), theirs ``(indices [T, k], logits [T, E])``."""

    ours: list[torch.Tensor] = dataclasses.field(default_factory=list)
    theirs: list[Choice] = dataclasses.field(default_factory=list)
    ours_logits: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def hook(self, module: nn.Module, _args: Any, output: Any) -> None:
        if isinstance(module, TopKRouter) and isinstance(output, Routing):
            self.ours.append(output.experts.detach().clone())
            self.ours_logits.append(output.logits.detach().float().clone())
        elif type(module).__name__.endswith("TopKRouter") and isinstance(output, tuple) and len(output) == 3:
            logits, _weights, indices = output
            self.theirs.append((indices.detach().clone(), logits.detach().float().clone()))

    def ours_as_reference(self) -> list[Choice]:
        """Our recorded calls in the form of a reference (``theirs``) for another of our models."""
        return list(zip(self.ours, self.ours_logits, strict=True))

    def check(self, tolerance: float, *, label: str = "to-hf verify", names: tuple[str, str] = ("checkpoint", "export"),
              reference: str = "transformers") -> int:  # fmt: skip
        """The number of MoE layers compared; :class:`UserError` naming the first layer whose
        choices differ (or when the two models routed a different number of times). ``names``:
        what the message calls our model and theirs; ``reference``: whose choices ours must equal."""
        return check_routes(self.ours, self.theirs, tolerance, label=label, names=names, reference=reference)


def check_routes(ours: list[torch.Tensor], theirs: list[Choice], tolerance: float, *, label: str,
                 names: tuple[str, str], reference: str) -> int:  # fmt: skip
    """See :meth:`Routes.check`: ``ours`` (indices per router call) against ``theirs``."""
    if len(ours) != len(theirs):
        raise UserError(
            f"{label}: the {names[0]} routed {len(ours)} times, the {names[1]} {len(theirs)} (MoE layers differ)"
        )
    for layer, (mine, (other, logits)) in enumerate(zip(ours, theirs, strict=True)):
        _check_layer(layer, mine, other, logits, tolerance, label=label, names=names, reference=reference)
    return len(ours)


def _check_layer(layer: int, ours: torch.Tensor, theirs: torch.Tensor, logits: torch.Tensor, tolerance: float,
                 *, label: str, names: tuple[str, str], reference: str) -> None:  # fmt: skip
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
            f"{label}: MoE layer {layer} (counting MoE layers) routes {int(differ.sum())} of "
            f"{differ.numel()} probe tokens to other experts than {reference} (token {t}: {names[0]} "
            f"{sorted(ours[t].tolist())}, {names[1]} {sorted(theirs[t].tolist())})"
        )


@contextlib.contextmanager
def record_routes() -> Iterator[Routes]:
    """Record every router call inside the block (see the module docstring)."""
    routes = Routes()
    handle = nn.modules.module.register_module_forward_hook(routes.hook)
    try:
        yield routes
    finally:
        handle.remove()
