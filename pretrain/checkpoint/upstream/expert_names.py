"""megatron-core's names of mixture-of-experts tensors <-> ours (the part after ``layers.N.``).

Ours (canonical, global expert index ``e``): ``mlp.router.weight [E, h]``,
``mlp.experts.{e}.dense_h_to_4h.weight [2I, h]`` (SwiGLU rows ``[gate; up]``),
``mlp.experts.{e}.dense_4h_to_h.weight [h, I]``, ``mlp.shared_experts.dense_h_to_4h/dense_4h_to_h.weight``
and ``mlp.shared_experts.gate_weight [1, h]``.

megatron-core, per layer module (``state_dict``, the legacy ``torch`` format; ``i`` local to the
file's EP rank):

* ``SequentialMLP``: ``mlp.experts.local_experts.{i}.linear_fc1.weight`` / ``linear_fc2.weight``;
* ``TEGroupedMLP``: ``mlp.experts.linear_fc1.weight{i}`` / ``linear_fc2.weight{i}``;
* the older ``GroupedMLP``: ``mlp.experts.weight1 [h, E_local * fc1_rows]`` and
  ``mlp.experts.weight2 [E_local * I, h]``, which it views as ``[E_local, h, fc1_rows]`` and
  ``[E_local, I, h]`` (every expert's weight transposed; see :func:`split_grouped`);
* shared experts ``mlp.shared_experts.linear_fc1/linear_fc2.weight``, ``mlp.shared_experts.gate_weight``.

``torch_dist`` (the sharded state dict every expert layout saves): one tensor per layer stack with
an expert axis, ``mlp.experts.experts.linear_fc1.weight [(L,) E, 2I, h]``, or with
``singleton_local_shards`` one key per global expert, ``mlp.experts.experts.{e}.linear_fc1.weight``
(SwiGLU: ``..._w`` gate rows and ``..._v`` up rows, two keys).
"""

from __future__ import annotations

import re

import torch

from pretrain.utils.errors import UserError

FC = {"1": "dense_h_to_4h", "2": "dense_4h_to_h"}
FC_BACK = {v: k for k, v in FC.items()}
_SEQUENTIAL = re.compile(r"^mlp\.experts\.(?:local_experts\.)?(\d+)\.linear_fc([12])\.(.+)$")
_TE_GROUPED = re.compile(r"^mlp\.experts\.linear_fc([12])\.(weight|bias)(\d+)$")
_SHARED = re.compile(r"^mlp\.shared_experts\.linear_fc([12])\.(.+)$")
_OURS_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(dense_h_to_4h|dense_4h_to_h)\.(.+)$")
_OURS_SHARED = re.compile(r"^mlp\.shared_experts\.(dense_h_to_4h|dense_4h_to_h)\.(.+)$")
# torch_dist: the expert-axis key (rest after ``layers.`` or ``layers.N.``), and per-expert keys
DIST_EXPERTS = re.compile(r"^mlp\.experts\.experts\.linear_fc([12])\.weight$")
DIST_SINGLETON = re.compile(r"^mlp\.experts\.experts\.(\d+)\.linear_fc([12])\.weight$")
# megatron-core buffers of the router that hold no weights of ours (expert_bias only with
# --moe-router-enable-expert-bias, which the option table refuses)
SKIPPED = ("mlp.router.expert_bias", "mlp.router.local_tokens_per_expert")
# any of our names of a routed expert (canonical or local index)
OUR_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def from_mcore_layer(rest: str) -> str | None:
    """Our name of megatron-core layer entry ``rest`` (after ``layers.N.``) if it is an MoE tensor
    of a per-layer ``state_dict`` (expert index kept as in the file); None otherwise."""
    if m := _SEQUENTIAL.match(rest):
        return f"mlp.experts.{m.group(1)}.{FC[m.group(2)]}.{m.group(3)}"
    if m := _TE_GROUPED.match(rest):
        return f"mlp.experts.{m.group(3)}.{FC[m.group(1)]}.{m.group(2)}"
    if m := _SHARED.match(rest):
        return f"mlp.shared_experts.{FC[m.group(1)]}.{m.group(2)}"
    return None


def to_mcore_layer(rest: str) -> str | None:
    """megatron-core's ``state_dict`` name (SequentialMLP, local spec) of our layer entry ``rest``."""
    if m := _OURS_EXPERT.match(rest):
        return f"mlp.experts.local_experts.{m.group(1)}.linear_fc{FC_BACK[m.group(2)]}.{m.group(3)}"
    if m := _OURS_SHARED.match(rest):
        return f"mlp.shared_experts.linear_fc{FC_BACK[m.group(1)]}.{m.group(2)}"
    return None


def to_dist_expert(rest: str) -> tuple[str, int] | None:
    """``(torch_dist rest, expert)`` of our routed-expert entry ``rest``; None for other tensors."""
    m = _OURS_EXPERT.match(rest)
    if m is None or m.group(3) != "weight":
        return None
    return f"mlp.experts.experts.linear_fc{FC_BACK[m.group(2)]}.weight", int(m.group(1))


def split_grouped(
    flat: dict[str, torch.Tensor], *, local_experts: int, hidden: int, where: str
) -> dict[str, torch.Tensor]:
    """``flat`` with every ``GroupedMLP`` pair ``mlp.experts.weight1/weight2`` replaced by
    per-expert ``mlp.experts.local_experts.{i}.linear_fc1/linear_fc2.weight`` (``[rows, h]`` and
    ``[h, I]``, as SequentialMLP holds them). A shape that is no whole number of experts: one line."""
    out: dict[str, torch.Tensor] = {}
    for key, t in flat.items():
        if not key.endswith((".mlp.experts.weight1", ".mlp.experts.weight2")):
            out[key] = t
            continue
        fc1 = key.endswith("weight1")
        ok = t.dim() == 2 and t.shape[1 if not fc1 else 0] == hidden
        ok = ok and t.shape[1 if fc1 else 0] % local_experts == 0
        if not ok:
            want = f"[{hidden}, {local_experts} x rows]" if fc1 else f"[{local_experts} x width, {hidden}]"
            raise UserError(
                f"{where}: tensor {key} has shape {tuple(t.shape)}, expected {want} "
                f"(GroupedMLP: {local_experts} local experts, hidden {hidden})"
            )
        # GroupedMLP views weight1 as [E, h, rows] and weight2 as [E, width, h]
        experts = t.reshape(local_experts, hidden, -1) if fc1 else t.reshape(local_experts, -1, hidden)
        base = key[: -len("weight1")]
        for i in range(local_experts):
            out[f"{base}local_experts.{i}.linear_fc{1 if fc1 else 2}.weight"] = experts[i].t()
    return out
