"""How full (single-process) tensors map to tensor-parallel shards, and back.

The canonical full form of a model is a dict from canonical names (Megatron legacy names with
global layer indices, see ``GPTModel.canonical_name``) to full tensors, with the word embeddings
*unpadded* ``[vocab, h]``. Each parallel parameter knows its split dimension
(``tp_partition_dim``); vocabulary tensors are padded with zero rows to the layout's padded size
before splitting and trimmed after gathering. This one mapping serves initialisation, tests,
resharding and Hugging Face conversion.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pretrain.models.base import ShardedModule
from pretrain.tensor_parallel.layers import partition_dim
from pretrain.tensor_parallel.mappings import ProcessGroup, group_size

VOCAB_TENSORS = ("word_embeddings.weight", "word_embeddings_for_head.weight", "lm_head.bias")


def is_vocab_tensor(name: str) -> bool:
    """Tensors whose rows are the (padded) vocabulary."""
    return name.endswith(VOCAB_TENSORS)


def shard_tensor(
    full: torch.Tensor, *, dim: int | None, tp_rank: int, tp: int, pad_rows_to: int | None = None
) -> torch.Tensor:
    """This rank's shard of ``full`` split along ``dim`` (``None``: replicated copy)."""
    if pad_rows_to is not None and full.shape[0] < pad_rows_to:
        pad = full.new_zeros((pad_rows_to - full.shape[0], *full.shape[1:]))
        full = torch.cat([full, pad], dim=0)
    if dim is None or tp == 1:
        return full.clone()
    return full.chunk(tp, dim=dim)[tp_rank].clone()


def unshard_tensors(
    parts: list[torch.Tensor], *, dim: int | None, trim_rows_to: int | None = None
) -> torch.Tensor:
    """Re-assemble shards (in TP-rank order) into the full tensor, trimming vocab padding."""
    full = parts[0] if dim is None or len(parts) == 1 else torch.cat(parts, dim=dim)
    return full[:trim_rows_to] if trim_rows_to is not None else full


def load_full_state_dict(model: ShardedModule, full: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy canonical full tensors into ``model``'s local shards (no communication)."""
    tp_rank, tp, padded = model.ps.tp_rank, model.ps.tp_size, model.padded_vocab
    for name, param in model.named_parameters():
        key = model.canonical_name(name)
        if key not in full:
            if strict:
                raise KeyError(f"full state dict has no tensor {key!r} (for parameter {name!r})")
            continue
        pad = padded if is_vocab_tensor(name) else None
        shard = shard_tensor(full[key], dim=partition_dim(param), tp_rank=tp_rank, tp=tp, pad_rows_to=pad)
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

    Collective over the TP group (all-gather per parallel tensor): call on every TP rank. For
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
        parts = _gather(t, group) if dim is not None else [t]
        key = model.canonical_name(name)
        out[key] = unshard_tensors(parts, dim=dim, trim_rows_to=vocab if is_vocab_tensor(name) else None)
    return out
