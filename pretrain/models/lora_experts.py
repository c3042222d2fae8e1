"""LoRA on the expert MLPs of a mixture-of-experts layer: every routed expert's and the shared
expert's ``fc1``/``fc2`` (never the router), sharded as the experts are.

**What the adapter is.** A routed expert ``e`` has its own adapter, ``A_e [r, in]``, ``B_e [out,
r]``, scaling ``alpha / r``: exactly PEFT's LoRA on transformers' fused expert parameters
(``target_parameters``: one rank-``r`` pair per expert of ``experts.gate_up_proj`` and
``experts.down_proj``), so ``fc1`` of a routed expert has *one* ``A`` for its fused gate/up rows
(unlike the dense SwiGLU ``fc1``, whose gate and up are separate HF modules with an ``A`` each).
The shared expert is made of plain HF linears (``shared_expert.gate_proj``...) and its ``fc1``
holds one ``A`` block per slice, as the dense MLP's (:mod:`pretrain.models.lora`). Dropout on
expert adapters is refused (:func:`~pretrain.models.lora.add_lora`): PEFT has none there.

**Sharding.** The expert linears are :class:`~pretrain.models.moe.experts.LocalLinear` shards
whose TP collectives the MoE layer owns: the input already sits in the TP region (its gradient
is summed over TP by the layer's f) and the output is partial (summed by the layer's g). So the
adapter adds no forward collective:

* ``fc1`` (rows split): ``A`` replicated, ``B`` split as the base rows (SwiGLU ``[gate slice; up
  slice]``). Each rank's ``A`` gradient covers only its ``B`` rows: ``A`` enters through f
  (backward all-reduce over the expert's TP group), and its input gradient stays partial like
  the base's.
* ``fc2`` (input split): ``A`` split along its input, ``B`` replicated. ``B z_t`` of each rank's
  partial ``z_t = A_t x_t`` is partial and summed by the layer's g; ``B``'s gradient is partial
  and enters through f.

A routed expert's group is the expert-TP group (whose ranks run the same rows: the dispatcher
all-gathers them when ETP != TP and reduce-scatters the partial outputs; none with ETP 1: whole
experts); the shared expert's is the TP group. Routed expert adapters are marked as expert parameters, so with EP
they live with their expert and their gradients reduce over the expert data-parallel group.
Every local expert runs once per forward on every rank (with zero rows if none), so the f
all-reduces pair across ranks.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from pretrain.models.base import ShardedModule
from pretrain.models.lora_ops import (
    LoraWeight,
    adapter_names,
    add_low_rank,
    block_diagonal_b,
    init_adapter_a,
    slice_mask,
)
from pretrain.models.moe.experts import ExpertMLP, LocalLinear, SharedExpertMLP
from pretrain.models.sharding import shard_tensor
from pretrain.tensor_parallel.layers import mark_expert
from pretrain.tensor_parallel.mappings import ProcessGroup, copy_to_tp_region

_LINEARS = (("dense_h_to_4h", "fc1"), ("dense_4h_to_h", "fc2"))


class LoraLocalLinear(LocalLinear):
    """A :class:`LocalLinear` expert shard with an adapter. ``fc1`` (``lora_column``): ``lora_A``
    ``[n r, in]`` (replicated), ``lora_B`` ``[out/t, r]``; ``fc2``: ``lora_A`` ``[r, in/t]``,
    ``lora_B`` ``[out, r]`` (replicated). ``x [n, in(/t)]`` -> ``[n, out(/t)]``, partial over the
    group like the base."""

    lora_A: LoraWeight
    lora_B: LoraWeight
    lora_slice_mask: torch.Tensor  # [out/t, n]: 1 where a local row belongs to slice j
    lora_scaling: float
    lora_column: bool
    lora_group: ProcessGroup | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        a, b = self.lora_A.weight, self.lora_B.weight
        # the replicated matrix's gradient is partial on each rank: f sums it over the group
        if self.lora_column:
            a = copy_to_tp_region(a, self.lora_group)
        else:
            b = copy_to_tp_region(b, self.lora_group)
        z = F.linear(x.to(a.dtype), a)  # [n, slices r]
        return add_low_rank(y, z, block_diagonal_b(b, self.lora_slice_mask), self.lora_scaling)


def attach_expert_adapters(
    model: ShardedModule, *, rank: int, scaling: float, targets: tuple[str, ...], seed: int
) -> None:
    """Give every expert MLP's ``fc1``/``fc2`` (those in ``targets``) of ``model`` its adapter (in
    place; ``A`` drawn full from ``(seed, canonical name)`` and sliced, ``B`` zero)."""
    ps = model.ps
    for name, module in list(model.named_modules()):
        if not isinstance(module, ExpertMLP):
            continue
        routed = not isinstance(module, SharedExpertMLP)
        group, tp, tp_rank = (
            (ps.etp_group, ps.etp_size, ps.etp_rank) if routed else (ps.tp_group, ps.tp_size, ps.tp_rank)
        )
        for sub, target in _LINEARS:
            if target not in targets:
                continue
            lin = cast(LocalLinear, getattr(module, sub))
            slices = 2 if target == "fc1" and module.swiglu and not routed else 1
            _attach(model, f"{name}.{sub}", lin, rank=rank, scaling=scaling, slices=slices, seed=seed,
                    group=group if tp > 1 else None, tp=tp, tp_rank=tp_rank, routed=routed)  # fmt: skip


def _attach(
    model: ShardedModule,
    name: str,
    lin: LocalLinear,
    *,
    rank: int,
    scaling: float,
    slices: int,
    seed: int,
    group: ProcessGroup | None,
    tp: int,
    tp_rank: int,
    routed: bool,
) -> None:
    """Give ``lin`` (local module ``name``, a shard of ``tp`` over ``group``, ``tp_rank`` in it) its
    adapter and the LoRA forward (in place: the class becomes :class:`LoraLocalLinear`)."""
    weight = lin.weight
    column = name.endswith("dense_h_to_4h")  # rows split (fc1) or input split (fc2)
    split = tp > 1
    in_full = weight.shape[1] * (1 if column else tp)
    a_name = adapter_names(model.canonical_name(f"{name}.weight"))[0]
    full_a = init_adapter_a(a_name, (slices * rank, in_full), seed=seed)
    local_a = shard_tensor(full_a, dim=None if column else 1, tp_rank=tp_rank if split else 0, tp=tp)
    lora_a = LoraWeight(local_a.to(weight.device), 1 if split and not column else None)
    lora_b = LoraWeight(
        torch.zeros(weight.shape[0], rank, device=weight.device), 0 if split and column else None
    )
    if routed:
        mark_expert(lora_a.weight)
        mark_expert(lora_b.weight)
    lin.__class__ = LoraLocalLinear
    lora = cast(LoraLocalLinear, lin)
    rows = list(torch.arange(weight.shape[0]).chunk(slices))  # SwiGLU: [gate slice; up slice]
    lora.register_buffer(
        "lora_slice_mask", slice_mask(rows, weight.shape[0], weight.device), persistent=False
    )
    lora.lora_A, lora.lora_B, lora.lora_scaling = lora_a, lora_b, scaling
    lora.lora_column, lora.lora_group = column, group
