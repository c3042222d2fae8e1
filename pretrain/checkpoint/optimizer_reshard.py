"""Reshard the (non-distributed) optimizer state of our checkpoints along with the model.

Each source rank file's ``optimizer`` entry is :meth:`MixedPrecisionOptimizer.state_dict` form:
``{"params": {"model{c}.{local name}": {"param", "exp_avg", "exp_avg_sq"}}, "step",
"param_groups", "grad_scaler"}``. Every state tensor is shaped like its parameter, so it is
gathered and re-split exactly like the parameter (same split dim, vocab rows padded with zeros).
Distributed-optimizer shards (``distrib_optim*.pt``) must first be reassembled with
:func:`pretrain.optim.distrib_optimizer.reassemble_full_state`; that step is not wired here yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from pretrain.checkpoint.plan import Slot
from pretrain.checkpoint.reader import LegacyReader
from pretrain.checkpoint.reshard import OPTIM_STATES, _shard
from pretrain.config import ParallelConfig
from pretrain.tensor_parallel.vocab import padded_vocab_size
from pretrain.utils.errors import UserError


def _chunk_index(chunk_key: str) -> int:
    return 0 if chunk_key == "model" else int(chunk_key[5:])


@dataclasses.dataclass
class _OptimizerView(LegacyReader):
    """The reader, but its tensors are one optimizer state (``param``, ``exp_avg``, ...)."""

    state_kind: str = "param"

    def _part(self, ref: tuple[int, str, str]) -> torch.Tensor:
        i, chunk, local = ref
        key = f"model{_chunk_index(chunk)}.{local}"
        params = (self.states[i].get("optimizer") or {}).get("params", {})
        if key not in params:
            raise UserError(f"{self.files[i]}: optimizer state has no entry {key!r}")
        return params[key][self.state_kind].view(self.flats[i][chunk][local].shape)


def optimizer_writer(
    reader: Any, target: ParallelConfig
) -> Callable[[int, int, list[list[Slot]]], dict[str, Any] | None]:
    """The ``optimizer`` callback of :func:`pretrain.checkpoint.reshard.write_layout`."""
    if not isinstance(reader, LegacyReader) or not reader.info.ours:
        raise UserError("--with-optimizer: only mlm-toolkit checkpoints carry a reshardable optimizer state")
    if any(next(f.parent.glob("distrib_optim*.pt"), None) for f in reader.files):
        raise UserError(
            "--with-optimizer: distributed-optimizer shards (distrib_optim*.pt) are not supported yet; "
            "reshard the model only (training restarts the optimizer)"
        )
    first = reader.states[0].get("optimizer")
    if not isinstance(first, dict) or "params" not in first:
        raise UserError(f"--with-optimizer: {reader.files[0]} holds no optimizer state")
    views = {
        kind: _OptimizerView(
            **{f.name: getattr(reader, f.name) for f in dataclasses.fields(reader)}, state_kind=kind
        )
        for kind in OPTIM_STATES
    }
    for view in views.values():
        view.head_copies = {}  # the head copy's state is checked through the model tensors
    cfg = reader.spec.cfg
    padded = padded_vocab_size(cfg.vocab_size, tp=target.tp, divisible_by=cfg.make_vocab_size_divisible_by)
    common = {k: first.get(k) for k in ("step", "param_groups", "grad_scaler")}

    def build(tp_rank: int, pp_rank: int, slots: list[list[Slot]]) -> dict[str, Any]:
        params: dict[str, dict[str, torch.Tensor]] = {}
        for c, chunk_slots in enumerate(slots):
            for slot in chunk_slots:
                params[f"model{c}.{slot.local}"] = {
                    kind: _shard(
                        view.tensor(slot.canonical).float(),
                        slot,
                        tp_rank=tp_rank,
                        tp=target.tp,
                        padded=padded,
                    )
                    for kind, view in views.items()
                }
        return {"params": params, **common}

    return build
