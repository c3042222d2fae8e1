"""LoRA checkpoints: the adapter alone, plus a reference to its base weights and their fingerprint.

A checkpoint saved during LoRA training (:func:`pretrain.training.checkpointing.save_training_checkpoint`
with ``lora_base``) is a Megatron-layout checkpoint whose rank files hold only the adapter shards
(with the optimizer, scheduler and RNG as usual, so resume is exact), and whose first rank
directory also holds :data:`ADAPTER_FILE`: the *full* canonical adapter tensors (layout-free, see
:mod:`pretrain.models.lora` for names and shapes) with this record::

    {"format": "mlm-lora/v1", "lora": {"rank", "alpha", "dropout", "targets"},
     "base": {"path": str, "fingerprint": "w1:..."}, "iteration": int | "release",
     "tensors": {canonical name: tensor}}

``base.path`` is the base checkpoint (or Hugging Face directory) the adapter was trained on and
``base.fingerprint`` its :func:`~pretrain.checkpoint.fingerprint.weights_fingerprint`: whoever
loads the adapter opens that base and checks the fingerprint (:func:`check_base`), so an adapter
is never applied to other weights. ``mlm-convert from-hf --adapter`` writes the same file alone
(iteration ``release``) for a PEFT adapter it keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pretrain.checkpoint.fingerprint import is_fingerprint, scheme_of, short_fingerprint
from pretrain.checkpoint.legacy.layout import iteration_dir, rank_dir_name, resolve_iteration, write_tracker
from pretrain.models.base import ShardedModule
from pretrain.models.lora import LoraConfig, is_lora_name
from pretrain.models.sharding import gather_full_state_dict
from pretrain.parallel.state import ParallelState
from pretrain.utils.atomic import atomic_directory
from pretrain.utils.errors import UserError

ADAPTER_FILE = "lora_adapter.pt"
FORMAT = "mlm-lora/v1"


@dataclass(frozen=True, kw_only=True)
class LoraBase:
    """The base weights an adapter belongs to: where they are and their weights fingerprint."""

    path: str
    fingerprint: str

    def __post_init__(self) -> None:
        if not is_fingerprint(self.fingerprint):
            raise UserError(f"LoRA base {self.path}: {self.fingerprint!r} is not a weights fingerprint")


@dataclass(frozen=True, kw_only=True)
class LoraAdapter:
    """A loaded adapter record: settings, base, iteration and full canonical tensors."""

    lora: LoraConfig
    base: LoraBase
    iteration: int | str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "lora": self.lora.to_dict(),
            "base": {"path": self.base.path, "fingerprint": self.base.fingerprint},
            "iteration": self.iteration,
            "tensors": self.tensors,
        }


def full_adapter_tensors(
    chunks: Sequence[ShardedModule], ps: ParallelState
) -> dict[str, torch.Tensor] | None:
    """Every stage's full adapter tensors, gathered on global rank 0 (None elsewhere): the first
    DP replica's, and with expert parallelism each EP rank's experts from its first expert-DP
    replica (the first DP replica holds only its own EP rank's experts).

    Collective: all-gathers over each TP group, then a gather over all ranks."""
    mine: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        mine.update({k: v.cpu() for k, v in gather_full_state_dict(chunk).items() if is_lora_name(k)})
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine if ps.dp_rank == 0 or (ps.ep_size > 1 and ps.edp_rank == 0) else {}, parts, dst=0)
    if parts is None:
        return None
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        out.update(part)
    return dict(sorted(out.items()))


def adapter_file_entry(
    chunks: Sequence[ShardedModule],
    ps: ParallelState,
    *,
    lora: LoraConfig,
    base: LoraBase,
    iteration: int | str,
) -> dict[str, Any] | None:
    """The :data:`ADAPTER_FILE` content on global rank 0, None on the other ranks (collective)."""
    tensors = full_adapter_tensors(chunks, ps)
    if tensors is None:
        return None
    return LoraAdapter(lora=lora, base=base, iteration=iteration, tensors=tensors).record()


def find_adapter_file(root: str | Path, iteration: int | str | None = None) -> Path | None:
    """The adapter file of ``root``'s iteration (the tracker's by default), or None (not LoRA)."""
    root = Path(root)
    if (root / ADAPTER_FILE).is_file():  # an iteration's rank directory given directly
        return root / ADAPTER_FILE
    direct = sorted(root.glob(f"*/{ADAPTER_FILE}"))  # an iteration directory given directly
    if direct and iteration is None:
        return direct[0]
    try:
        it_dir = resolve_iteration(root, iteration)
    except (UserError, OSError):
        return None
    found = sorted(it_dir.glob(f"*/{ADAPTER_FILE}"))
    return found[0] if found else None


def is_lora_checkpoint(root: str | Path, iteration: int | str | None = None) -> bool:
    return find_adapter_file(root, iteration) is not None


def read_adapter(root: str | Path, iteration: int | str | None = None) -> LoraAdapter:
    """Load the adapter record of a LoRA checkpoint (``UserError`` naming the file otherwise)."""
    from pretrain.checkpoint.legacy.io import load_rank_file

    path = find_adapter_file(root, iteration)
    if path is None:
        raise UserError(f"{root}: not a LoRA checkpoint (no {ADAPTER_FILE})")
    state = load_rank_file(path)
    if state.get("format") != FORMAT:
        raise UserError(f"{path}: format {state.get('format')!r}, expected {FORMAT!r}")
    try:
        lora = LoraConfig.from_dict(state["lora"])
        base = LoraBase(path=str(state["base"]["path"]), fingerprint=str(state["base"]["fingerprint"]))
        tensors = dict(state["tensors"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path}: malformed LoRA record ({exc})") from None
    bad = [k for k, v in tensors.items() if not is_lora_name(k) or not isinstance(v, torch.Tensor)]
    if bad:
        raise UserError(f"{path}: tensor {bad[0]} is not a LoRA adapter tensor")
    return LoraAdapter(lora=lora, base=base, iteration=state.get("iteration", "release"), tensors=tensors)


def check_base(
    adapter: LoraAdapter, fingerprint: str, *, where: str, recompute: Callable[[str], str] | None = None
) -> None:
    """``UserError`` (one line) unless the base weights at hand (``fingerprint``) are the adapter's
    base. A base recorded under another scheme (``w1`` before ``w2``) is compared with
    ``recompute(scheme)``, the weights at hand hashed under it; without ``recompute`` that is
    refused, naming the scheme."""
    recorded = scheme_of(adapter.base.fingerprint)
    if scheme_of(fingerprint) != recorded:
        if recompute is None:
            raise UserError(
                f"{where}: the LoRA adapter records its base under fingerprint scheme {recorded}, "
                f"these weights were hashed under {scheme_of(fingerprint)}"
            )
        fingerprint = recompute(recorded)
    if fingerprint != adapter.base.fingerprint:
        raise UserError(
            f"{where}: the base weights (fingerprint {short_fingerprint(fingerprint)}) are not the ones "
            f"this LoRA adapter was trained on ({adapter.base.path}, {short_fingerprint(adapter.base.fingerprint)})"
        )


def write_adapter_checkpoint(root: str | Path, adapter: LoraAdapter) -> Path:
    """Write ``adapter`` alone as a LoRA checkpoint at ``root`` (iteration dir, tracker); atomic:
    ``root`` appears complete or not at all."""
    with atomic_directory(root) as tmp:
        rank_dir = iteration_dir(tmp, adapter.iteration) / rank_dir_name(0, 0, 1)
        rank_dir.mkdir(parents=True)
        torch.save(adapter.record(), rank_dir / ADAPTER_FILE)
        write_tracker(tmp, adapter.iteration)
    return Path(root)
