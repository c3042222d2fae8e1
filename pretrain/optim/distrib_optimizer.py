"""ZeRO-1 distributed optimizer (Megatron-LM's ``DistributedOptimizer``).

Every gradient buffer bucket is split into ``d`` equal contiguous shards (see
:mod:`pretrain.distributed.grad_buffer`); data-parallel rank k owns shard k. For each parameter
overlapping its shard the rank records three ranges, as Megatron does:

* ``world``: the overlap in buffer coordinates;
* ``local``: the same elements in this rank's flat shard (its bucket shards concatenated);
* ``param``: the same elements in the flattened parameter.

The rank keeps fp32 main params, fp32 grads (views when the buffer is fp32) and Adam state for
those elements only. A step: gradients are reduce-scattered by DDP (``finish_grad_sync``), the
shard is unscaled/clipped/stepped, updated values are written into the flat parameter buffer and
all-gathered over ``ps.dp_group``. Norms and the overflow flag combine over the DP group and the
model-parallel group (each rank holds disjoint pieces).

Checkpoints: :meth:`DistributedOptimizer.sharded_state_dict` is one rank's ``distrib_optim.pt``
(flat fp32 ``param``/``exp_avg``/``exp_avg_sq`` of its shard per buffer, plus the index map);
:func:`reassemble_full_state` turns all ranks' shards into the non-distributed
:meth:`MixedPrecisionOptimizer.full_state` form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pretrain.distributed.grad_buffer import GradBuffer, Range
from pretrain.optim.clip_grads import counts_for_norm
from pretrain.optim.optimizer import MainParam, MixedPrecisionOptimizer, make_main_param
from pretrain.optim.param_groups import uses_weight_decay
from pretrain.tensor_parallel.layers import is_expert

FLAT_STATES = ("param", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class ShardRanges:
    """Where one parameter's owned elements live (Megatron's ``world``/``local``/``param``)."""

    world: Range
    local: Range
    param: Range


def buffer_shard_ranges(buf: GradBuffer, dp_rank: int, dp_size: int) -> dict[int, ShardRanges]:
    """``id(param) -> ShardRanges`` for the parameters of ``buf`` overlapping ``dp_rank``'s shard."""
    out: dict[int, ShardRanges] = {}
    local_offset = 0
    for bucket in buf.buckets:
        shard = bucket.shard_range(dp_rank, dp_size)
        for p in bucket.params:
            r = buf.index[id(p)]
            start, end = max(r.start, shard.start), min(r.end, shard.end)
            if start < end:
                world = Range(start, end)
                local = Range(local_offset + start - shard.start, local_offset + end - shard.start)
                out[id(p)] = ShardRanges(world, local, Range(start - r.start, end - r.start))
        local_offset += shard.size
    return out


class DistributedOptimizer(MixedPrecisionOptimizer):
    """ZeRO-1: optimizer state and fp32 main params for this DP rank's shard only."""

    def _build_mains(self) -> list[MainParam]:
        names = {id(p): (key, name) for key, name, p in self._named_params()}
        self._local: list[list[tuple[MainParam, ShardRanges]]] = []  # per buffer, in buffer order
        mains: list[MainParam] = []
        for d in self.ddps:
            for buf, (_, rank, size) in zip(d.buffers, d.buffer_dp, strict=True):
                ranges = buffer_shard_ranges(buf, rank, size)  # expert buffers: over expert DP
                entries = []
                for p in reversed(buf.params):
                    if id(p) not in ranges:
                        continue
                    key, name = names[id(p)]
                    pr = ranges[id(p)].param
                    m = make_main_param(
                        key,
                        p,
                        p.data.view(-1)[pr.start : pr.end],
                        p.main_grad.view(-1)[pr.start : pr.end],  # type: ignore[attr-defined]
                        decay=uses_weight_decay(name, p),
                        counted=counts_for_norm(name, p, self.ps),
                    )
                    entries.append((m, ranges[id(p)]))
                    mains.append(m)
                self._local.append(entries)
        return mains

    def _norm_groups(self) -> list[dist.ProcessGroup | None]:
        return [self.ps.dp_group, self.ps.mp_group]

    def _expert_norm_groups(self) -> list[dist.ProcessGroup | None]:
        return [self.ps.edp_group, self.ps.expert_mp_group]

    def _copy_main_to_model(self) -> None:
        super()._copy_main_to_model()  # into this rank's shard of the flat param buffers
        for d in self.ddps:
            d.all_gather_params()

    # --- state ----------------------------------------------------------------------------------
    def _buffers(self) -> list[GradBuffer]:
        return [buf for d in self.ddps for buf in d.buffers]

    def _buffer_shards(self) -> list[tuple[int, int]]:
        """``(rank, size)`` of this rank's shard of each buffer (expert buffers: over expert DP)."""
        return [(rank, size) for d in self.ddps for _, rank, size in d.buffer_dp]

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard: per buffer flat fp32 ``param``/``exp_avg``/``exp_avg_sq`` of length
        ``numel / d`` (padding zero), with the buffer's index map so shards can be reassembled
        without the model. Scalars (step, lr, scaler) are identical on every DP rank."""
        keys = {id(p): key for key, _, p in self._named_params()}
        buffers = []
        experts = [any(is_expert(p) for p in buf.params) for buf in self._buffers()]
        for buf, entries, (rank, size), expert in zip(
            self._buffers(), self._local, self._buffer_shards(), experts, strict=True
        ):
            shard_numel = buf.numel // size
            flat = {k: torch.zeros(shard_numel, dtype=torch.float32) for k in FLAT_STATES}
            for m, r in entries:
                st = self.adam.state[m.main]
                for k, t in (("param", m.main), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"])):
                    flat[k][r.local.start : r.local.end] = t.detach().cpu()
            index = [
                (keys[id(p)], tuple(p.shape), buf.index[id(p)].start, buf.index[id(p)].end)
                for p in buf.params
            ]
            buffers.append(
                {
                    "numel": buf.numel,
                    "buckets": [(b.start, b.end) for b in buf.buckets],
                    "index": index,
                    **flat,
                    # an expert buffer sharded over expert DP (not the dense DP group), holding
                    # this EP rank's experts (local indices)
                    **(
                        {"shard_rank": rank, "shard_size": size, "ep_rank": self.ps.ep_rank}
                        if size != self.ps.dp_size or (expert and self.ps.ep_size > 1)
                        else {}
                    ),
                }
            )
        common = self.state_dict_common()
        return {"dp_rank": self.ps.dp_rank, "dp_size": self.ps.dp_size, "buffers": buffers, **common}

    def state_dict_common(self) -> dict[str, Any]:
        return {
            "step": self.adam_step_count(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.adam.param_groups],
            "grad_scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    def state_dict(self) -> dict[str, Any]:
        """Not available per rank: use :meth:`sharded_state_dict` and :func:`reassemble_full_state`."""
        raise NotImplementedError("DistributedOptimizer state is sharded: use sharded_state_dict()")

    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        raise NotImplementedError("DistributedOptimizer state is sharded: use reassemble_full_state()")

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Load this rank's shard (saved with the same layout and d), then all-gather params.

        Collective over the DP group (the parameter all-gather)."""
        if state["dp_size"] != self.ps.dp_size or state["dp_rank"] != self.ps.dp_rank:
            raise ValueError(
                f"shard is for dp rank {state['dp_rank']}/{state['dp_size']}, this is "
                f"{self.ps.dp_rank}/{self.ps.dp_size}: reassemble and reshard it instead"
            )
        for buf, entries, saved in zip(self._buffers(), self._local, state["buffers"], strict=True):
            if saved["numel"] != buf.numel:
                raise ValueError(f"buffer size {saved['numel']} in the shard != {buf.numel} in the model")
            for m, r in entries:
                sl = slice(r.local.start, r.local.end)
                self._load_main(
                    m, saved["param"][sl], saved["exp_avg"][sl], saved["exp_avg_sq"][sl], state["step"]
                )
        self._load_common(state)
        self._copy_main_to_model()

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """Load the non-distributed form (:meth:`MixedPrecisionOptimizer.state_dict`, e.g. a
        resharded checkpoint or :func:`reassemble_full_state` of another DP size) by taking this
        rank's element ranges of every parameter, then all-gather params.

        Collective over the DP group (the parameter all-gather)."""
        params = state["params"]
        named = {key: p for key, _, p in self._named_params()}
        missing = sorted(set(named) - set(params))
        if missing:
            raise KeyError(f"optimizer state has no entry for {missing[:3]}")
        for key, p in named.items():
            if params[key]["param"].numel() != p.numel():
                shape = tuple(params[key]["param"].shape)
                raise ValueError(f"optimizer state {key} has shape {shape}, the parameter {tuple(p.shape)}")
        for entries in self._local:
            for m, r in entries:
                sl = slice(r.param.start, r.param.end)
                main, avg, sq = (params[m.key][k].reshape(-1)[sl] for k in FLAT_STATES)
                self._load_main(m, main, avg, sq, state["step"])
        self._load_common({**state, "param_groups": self._matching_groups(state["param_groups"])})
        self._copy_main_to_model()

    def _matching_groups(self, saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The saved hyperparameter groups for this rank's Adam groups: a shard may lack the
        decay or the no-decay group (empty groups are dropped), so match by ``weight_decay``."""
        if len(saved) == len(self.adam.param_groups):
            return saved
        out = []
        for group in self.adam.param_groups:
            same = [g for g in saved if g.get("weight_decay") == group["weight_decay"]]
            out.append({**(same or saved)[0], "weight_decay": group["weight_decay"]})
        return out


def _assemble(meta: dict[str, Any], parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """One buffer's flat state (``meta["numel"]``) from its shards ``parts`` in rank order: each
    bucket is split into ``len(parts)`` equal contiguous pieces, rank k's piece is in its shard."""
    full = torch.zeros(meta["numel"], dtype=torch.float32)
    offset, d = 0, len(parts)
    for start, end in meta["buckets"]:
        per = (end - start) // d
        for rank, part in enumerate(parts):
            full[start + rank * per : start + (rank + 1) * per] = part[offset : offset + per]
        offset += per
    return full


def _expert_parts(shards: Sequence[dict[str, Any]], b: int, ep_rank: int) -> list[dict[str, Any]]:
    """Expert buffer ``b`` of EP rank ``ep_rank`` from every expert-DP rank, in shard-rank order."""
    if any("ep_rank" not in s["buffers"][b] for s in shards):
        raise ValueError(
            "expert parameters are sharded over the expert data-parallel group and the shards do not "
            "record their EP rank (saved by an older version): resume with the same layout"
        )
    mine = sorted((s["buffers"][b] for s in shards if s["buffers"][b]["ep_rank"] == ep_rank),
                  key=lambda buf: buf["shard_rank"])  # fmt: skip
    size = mine[0]["shard_size"] if mine else 0
    if not mine or [buf["shard_rank"] for buf in mine] != list(range(size)):
        got = [buf["shard_rank"] for buf in mine]
        raise ValueError(f"need all {size} expert-DP shards of EP rank {ep_rank}, got {got}")
    return mine


def reassemble_full_state(
    shards: Sequence[dict[str, Any]],
    *,
    ep_rank: int | None = None,
    expert_shards: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Combine every DP rank's :meth:`DistributedOptimizer.sharded_state_dict` (any order) into
    the non-distributed form: ``{"params": {key: {"param", "exp_avg", "exp_avg_sq"}}, "step",
    "param_groups", "grad_scaler"}`` with tensors shaped like the parameters. Pure function.

    With expert parallelism the expert buffers are sharded over the expert-DP group of each EP
    rank (the DP ranks that share its experts): ``ep_rank`` picks whose experts (local indices)
    are reassembled, from ``expert_shards`` (default ``shards``: with ETP below TP the expert-DP
    group spans other TP ranks' DP groups); the dense buffers come from all DP ranks."""
    shards = sorted(shards, key=lambda s: s["dp_rank"])
    d = shards[0]["dp_size"]
    if [s["dp_rank"] for s in shards] != list(range(d)):
        raise ValueError(f"need the shards of all {d} DP ranks, got ranks {[s['dp_rank'] for s in shards]}")
    params: dict[str, dict[str, torch.Tensor]] = {}
    for b, meta in enumerate(shards[0]["buffers"]):
        if "shard_size" in meta:
            if ep_rank is None:
                raise ValueError("expert parameters are sharded over expert DP: say which EP rank's")
            parts = _expert_parts(shards if expert_shards is None else expert_shards, b, ep_rank)
            meta = parts[0]
        else:
            parts = [s["buffers"][b] for s in shards]
        for k in FLAT_STATES:
            full = _assemble(meta, [part[k] for part in parts])
            for key, shape, start, end in meta["index"]:
                params.setdefault(key, {})[k] = full[start:end].view(shape).clone()
    common = {k: shards[0][k] for k in ("step", "grad_scaler")}
    groups = max((s["param_groups"] for s in shards), key=len)  # a shard may lack a group
    return {"params": params, "param_groups": groups, **common}
