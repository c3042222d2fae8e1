"""How full (single-process) tensors map to tensor-parallel shards, and back.

The canonical full form of a model is a dict from canonical names (Megatron legacy names with
global layer indices, see ``GPTModel.canonical_name``) to full tensors, with the word embeddings
*unpadded* ``[vocab, h]``. Each parallel parameter knows its split dimension
(``tp_partition_dim``); vocabulary tensors are padded with zero rows to the layout's padded size
before splitting and trimmed after gathering. This one mapping serves initialisation, tests,
resharding and Hugging Face conversion.

Two column-parallel tensors have rows with more structure than a plain split (:class:`RowLayout`,
found from the canonical name by :func:`row_layout`), both laid out as Megatron does:

* fused QKV (weight ``[(nq + 2 g) d, h]`` and bias): rows ``[g groups][q heads of the group, k,
  v][d]``. With ``tp <= g`` each rank holds ``g / tp`` whole groups (a plain row split). With
  ``tp > g`` (``tp`` a multiple of ``g``: evaluation and resharding only) the ``r = tp / g`` ranks of
  a group each hold ``nq / tp`` of its query heads and a *replica* of its key and value head.
* SwiGLU ``dense_h_to_4h`` (``[2 ffn, h]`` and bias): rows ``[gate; up]``; each rank holds
  ``[its gate slice; its up slice]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from pretrain.config import ModelConfig
from pretrain.models.base import ShardedModule
from pretrain.tensor_parallel.layers import is_expert, partition_dim
from pretrain.tensor_parallel.mappings import ProcessGroup, group_size
from pretrain.utils.buffer_pool import pooled_cat

VOCAB_TENSORS = (
    "word_embeddings.weight", "word_embeddings_for_head.weight", "lm_head.bias", "output_layer.weight",
)  # fmt: skip
# LoRA's B rows (pretrain.models.lora) are laid out and sharded as the base rows they update
QKV_TENSORS = ("query_key_value.weight", "query_key_value.bias", "query_key_value.lora_B.weight")
# the dense MLP's, each routed expert's (mlp.experts.{e}.) and the shared expert's fc1
SWIGLU_TENSORS = ("dense_h_to_4h.weight", "dense_h_to_4h.bias", "dense_h_to_4h.lora_B.weight")
Replicas = Literal["check", "first", "sum"]


def is_vocab_tensor(name: str) -> bool:
    """Tensors whose rows are the (padded) vocabulary."""
    return name.endswith(VOCAB_TENSORS)


@dataclass(frozen=True, kw_only=True)
class RowLayout:
    """Row structure of a column-parallel tensor (split along dim 0) beyond a plain split.

    ``blocks``: the rows are that many equal blocks, each split over TP (SwiGLU: 2).
    ``groups``: fused QKV rows ``[groups][q_per_group + 2][head_dim]`` (``None``: not QKV).
    """

    blocks: int = 1
    groups: int | None = None
    q_per_group: int = 1
    head_dim: int = 1


def row_layout(name: str, cfg: ModelConfig) -> RowLayout | None:
    """The :class:`RowLayout` of the tensor with canonical (or local) ``name``, if it has one."""
    if name.endswith(QKV_TENSORS):
        groups = cfg.query_groups
        return RowLayout(groups=groups, q_per_group=cfg.num_attention_heads // groups, head_dim=cfg.head_dim)
    if cfg.swiglu and name.endswith(SWIGLU_TENSORS):
        return RowLayout(blocks=2)
    return None


def local_rows(layout: RowLayout | None, full_rows: int, tp: int) -> int:
    """Rows of one TP rank's shard of a tensor with ``full_rows`` rows."""
    if layout is not None and layout.groups is not None and tp > layout.groups:
        return (layout.q_per_group * layout.groups // tp + 2) * layout.head_dim
    return full_rows // tp


def _shard_qkv_replicated(full: torch.Tensor, lay: RowLayout, tp_rank: int, tp: int) -> torch.Tensor:
    assert lay.groups is not None
    reps = tp // lay.groups
    group, sub = divmod(tp_rank, reps)
    q = lay.q_per_group // reps
    x = full.reshape(lay.groups, lay.q_per_group + 2, lay.head_dim, *full.shape[1:])[group]
    rows = torch.cat([x[sub * q : (sub + 1) * q], x[lay.q_per_group :]], dim=0)
    return rows.reshape(-1, *full.shape[1:])


def _unshard_qkv_replicated(parts: list[torch.Tensor], lay: RowLayout, replicas: Replicas) -> torch.Tensor:
    assert lay.groups is not None
    reps = len(parts) // lay.groups
    q = lay.q_per_group // reps
    rest = parts[0].shape[1:]
    groups = []
    for g in range(lay.groups):
        mine = [p.reshape(q + 2, lay.head_dim, *rest) for p in parts[g * reps : (g + 1) * reps]]
        kv = mine[0][q:]
        if replicas == "sum":
            kv = torch.stack([m[q:] for m in mine]).sum(0)
        elif replicas == "check" and any(not torch.equal(m[q:], kv) for m in mine[1:]):
            raise ValueError(f"replicated key/value heads of query group {g} differ between TP ranks")
        groups.append(torch.cat([*(m[:q] for m in mine), kv], dim=0))
    return torch.stack(groups).reshape(-1, *rest)


def _padded_rows(full: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Rows ``[start, start + count)`` of ``full`` followed by zero rows (a new tensor)."""
    out = full.new_zeros((count, *full.shape[1:]))
    have = full[start : start + count]
    out[: have.shape[0]] = have
    return out


def shard_tensor(
    full: torch.Tensor,
    *,
    dim: int | None,
    tp_rank: int,
    tp: int,
    pad_rows_to: int | None = None,
    layout: RowLayout | None = None,
    copy: bool = True,
) -> torch.Tensor:
    """This rank's shard of ``full`` split along ``dim`` (``None``: replicated copy).

    ``layout`` (dim 0 only): SwiGLU blocks are split one by one; QKV groups are replicated when
    ``tp`` exceeds their number. ``copy=False``: the shard may be a view of ``full`` (a file
    writer that only reads it saves a copy of every tensor).
    """
    done = (lambda t: t.clone()) if copy else (lambda t: t)
    if pad_rows_to is not None and full.shape[0] < pad_rows_to:
        if layout is None and pad_rows_to % tp == 0 and (dim in (None, 0) or tp == 1):
            # the rank's rows of the padded tensor, without first building the padded whole
            # (for the vocabulary tensors, the largest of a model, that copy was the peak)
            per = pad_rows_to if dim is None or tp == 1 else pad_rows_to // tp
            start = 0 if dim is None or tp == 1 else tp_rank * per
            return _padded_rows(full, start, per)
        pad = full.new_zeros((pad_rows_to - full.shape[0], *full.shape[1:]))
        full = torch.cat([full, pad], dim=0)
    if dim is None or tp == 1:
        return done(full)
    if layout is not None and dim == 0:
        if layout.blocks > 1:
            return done(torch.cat([b.chunk(tp, dim=0)[tp_rank] for b in full.chunk(layout.blocks, dim=0)]))
        if layout.groups is not None and tp > layout.groups:
            return done(_shard_qkv_replicated(full, layout, tp_rank, tp))
    return done(full.chunk(tp, dim=dim)[tp_rank])


def row_order(parts: list[torch.Tensor], *, layout: RowLayout | None) -> list[torch.Tensor] | None:
    """The row blocks of TP shards split along dim 0, in the full tensor's order (SwiGLU: every
    rank's gate, then every rank's up): joining them is stacking these. None where the join does
    more (QKV groups replicated over ``tp > groups`` ranks). Used by :func:`unshard_tensors` and by
    readers that hand the blocks to a consumer unjoined (the weights fingerprint)."""
    if layout is not None and layout.groups is not None and len(parts) > layout.groups:
        return None
    if layout is not None and layout.blocks > 1:
        blocks = [p.chunk(layout.blocks, dim=0) for p in parts]
        return [b[i] for i in range(layout.blocks) for b in blocks]
    return list(parts)


def unshard_tensors(
    parts: list[torch.Tensor],
    *,
    dim: int | None,
    trim_rows_to: int | None = None,
    layout: RowLayout | None = None,
    replicas: Replicas = "check",
) -> torch.Tensor:
    """Re-assemble shards (in TP-rank order) into the full tensor, trimming vocab padding.

    ``replicas`` says what to do with replicated key/value heads (``tp > groups``): ``check``
    they are equal (``ValueError`` otherwise), take the ``first``, or ``sum`` them (gradients).
    Joined tensors come from the conversion's buffer pool when one is active
    (:func:`~pretrain.utils.buffer_pool.pooled_cat`).
    """
    ordered = row_order(parts, layout=layout) if dim == 0 else None
    if dim is None or len(parts) == 1:
        full = parts[0]
    elif dim == 0 and ordered is None:
        assert layout is not None  # row_order declines only replicated QKV groups
        full = _unshard_qkv_replicated(parts, layout, replicas)
    else:
        full = pooled_cat(ordered if ordered is not None else parts, dim)  # one copy, not two
    return full[:trim_rows_to] if trim_rows_to is not None else full


def load_full_state_dict(
    model: ShardedModule, full: Mapping[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Copy canonical full tensors into ``model``'s local shards (no communication; routed
    experts are split over the expert-TP group)."""
    ps, padded = model.ps, model.padded_vocab
    for name, param in model.named_parameters():
        tp_rank, tp = (ps.etp_rank, ps.etp_size) if is_expert(param) else (ps.tp_rank, ps.tp_size)
        key = model.canonical_name(name)
        if key not in full:
            if strict:
                raise KeyError(f"full state dict has no tensor {key!r} (for parameter {name!r})")
            continue
        pad = padded if is_vocab_tensor(name) else None
        lay = row_layout(key, model.cfg)
        shard = shard_tensor(
            full[key], dim=partition_dim(param), tp_rank=tp_rank, tp=tp, pad_rows_to=pad, layout=lay
        )
        if shard.shape != param.shape:
            raise ValueError(
                f"tensor {key!r}: shard shape {tuple(shard.shape)} != parameter {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(shard)


def _gather(x: torch.Tensor, group: ProcessGroup | None) -> list[torch.Tensor]:
    if group_size(group) == 1:
        return [x]
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def gather_full_state_dict(model: ShardedModule, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors (or their gradients) of this stage's parameters, keyed by canonical name.

    Collective over the TP group (all-gather per parallel tensor; routed experts over the
    expert-TP group): call on every rank of both. For
    ``grads=True`` a missing gradient is returned as zeros. Uses ``main_grad`` when present.
    """
    group = model.ps.tp_group
    vocab = model.cfg.vocab_size
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        t = param.detach()
        if grads:
            g = getattr(param, "main_grad", None)
            g = param.grad if g is None else g
            t = torch.zeros_like(param) if g is None else g.detach()
        dim = partition_dim(param)
        parts = _gather(t, model.ps.etp_group if is_expert(param) else group) if dim is not None else [t]
        key = model.canonical_name(name)
        out[key] = unshard_tensors(
            parts,
            dim=dim,
            trim_rows_to=vocab if is_vocab_tensor(name) else None,
            layout=row_layout(key, model.cfg),
            replicas="sum" if grads else "check",
        )
    return out
