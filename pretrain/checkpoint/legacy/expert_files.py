"""Legacy files per expert-parallel rank (``mp_rank_TT[_PPP]_EEE``), read as one checkpoint.

Each (TP, PP) rank's EP files hold the same dense tensors and their own experts under local
indices; :func:`merge_expert_ranks` keeps EP rank 0's dense tensors and every rank's experts under
global indices (:func:`~pretrain.checkpoint.expert_layout.globalise`, GroupedMLP pairs split),
:func:`check_expert_files` names the file of a missing or unexpected expert tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint.expert_layout import (
    expert_index,
    experts_per_rank,
    globalise,
    renumber_expert,
    slots_of_ep_rank,
)
from pretrain.checkpoint.legacy.layout import MODEL_FILE, flatten
from pretrain.checkpoint.plan import ModelSpec, chunk_slots, layers_from_counts
from pretrain.checkpoint.safe_unpickle import load_untrusted
from pretrain.checkpoint.upstream.names import to_local_name
from pretrain.utils.errors import UserError


def merge_optimizer(states: list[dict[str, Any]], i: int, state: dict[str, Any], offset: int) -> None:
    """Our full-form optimizer entry of EP rank file ``state`` (experts numbered from ``offset``)
    merged into ``states[i]``'s, keyed by global expert index (nothing when either has none)."""
    mine, theirs = states[i].get("optimizer"), state.get("optimizer")
    if not (isinstance(mine, dict) and isinstance(theirs, dict) and "params" in mine and "params" in theirs):
        return
    params = dict(mine["params"])
    params.update(
        (renumber_expert(k, offset), v) for k, v in theirs["params"].items() if expert_index(k) is not None
    )
    states[i] = {**states[i], "optimizer": {**mine, "params": params}}


def expert_tp_of(args: dict[str, Any], *, tp: int, where: str) -> int:
    """The expert-TP size legacy files of TP size ``tp`` hold (args ``expert_tensor_parallel_size``,
    default ``tp``). Megatron names rank files by TP, PP and EP rank only (``get_checkpoint_name``):
    TP rank t's file holds the experts of expert-TP rank ``t % ETP``, which is that rank's own only
    when ETP divides TP; other sizes have no files of their own (one line)."""
    etp = int(args.get("expert_tensor_parallel_size") or tp)
    if tp % etp:
        raise UserError(
            f"{where}: expert_tensor_parallel_size {etp} does not divide tensor_model_parallel_size {tp}: "
            "legacy rank files (mp_rank_TT[_PPP][_EEE]) cannot hold such expert shards"
        )
    return etp


def merge_expert_ranks(
    flats: list[dict[str, dict[str, torch.Tensor]]],
    states: list[dict[str, Any]],
    dirs: dict[tuple[int, int, int], Path],
    args: dict[str, Any],
    *,
    tp: int,
    pp: int,
    ep: int,
    chunk_keys: list[str],
    chunk_keys_of: Callable[[dict[str, Any], Path], list[str]],
    ep_ranks: list[int] | None = None,
) -> tuple[list[dict[str, dict[str, torch.Tensor]]], list[Path]]:
    """Per (TP, PP) rank: the first EP rank's tensors (``flats``) plus the other EP ranks'
    experts, global indices (:func:`~pretrain.checkpoint.expert_layout.globalise`); and the other
    files read. ``ep_ranks``: the EP rank files to read (default all), ``flats`` the first's."""
    ep_ranks = list(range(ep)) if ep_ranks is None else ep_ranks
    experts, hidden = int(args["num_experts"]), int(args.get("hidden_size") or 0)
    if experts % ep:
        raise UserError(
            f"{dirs[(0, 0, 0)].parent}: args say num_experts {experts}, not divisible by "
            f"expert_model_parallel_size {ep}"
        )
    expert_tp_of(args, tp=tp, where=str(dirs[(0, 0, 0)].parent))
    per, out, extra_files = experts // ep, [], []
    for p in range(pp):
        for t in range(tp):
            merged = {
                ck: globalise(flat, ep_rank=ep_ranks[0], per_rank=per, hidden=hidden,
                              path=dirs[(t, p, ep_ranks[0])] / MODEL_FILE)
                for ck, flat in flats[p * tp + t].items()
            }  # fmt: skip
            for e in ep_ranks[1:]:
                path = dirs[(t, p, e)] / MODEL_FILE
                state = load_untrusted(path)
                if chunk_keys_of(state, path) != chunk_keys:
                    raise UserError(
                        f"{path}: holds chunks {chunk_keys_of(state, path)}, expected {chunk_keys}"
                    )
                for ck in chunk_keys:
                    mine = globalise(flatten(state[ck]), ep_rank=e, per_rank=per, hidden=hidden, path=path)
                    merged[ck].update(
                        (k, v) for k, v in mine.items() if expert_index(to_local_name(k) or "") is not None
                    )
                merge_optimizer(states, p * tp + t, state, e * per)
                extra_files.append(path)
            out.append(merged)
    return out, extra_files


def check_expert_files(
    spec: ModelSpec,
    locals_: dict[tuple[int, int, int], dict[str, str]],
    dirs: dict[tuple[int, int, int], Path],
    counts: list[list[int]],
    *,
    tp: int,
    ep: int,
    keep: Callable[[str], bool] = lambda _name: True,
) -> None:
    """Every routed expert tensor is in its EP rank's file, and no other: one line naming the
    file and the first missing (or unexpected) tensor. ``keep``: the experts read (the others'
    files are not opened)."""
    per = experts_per_rank(spec.cfg, ep, what="expert_model_parallel_size")
    layers = layers_from_counts(counts)
    for s, stage in enumerate(layers):
        for c, numbers in enumerate(stage):
            pre, post = s == 0 and c == 0, s == len(layers) - 1 and c == len(stage) - 1
            slots = chunk_slots(spec, tp=tp, pre_process=pre, post_process=post, layer_numbers=numbers)
            want = {x.local for x in slots if expert_index(x.local) is not None and keep(x.local)}
            for t in range(tp):
                have = {n for n in locals_[(t, s, c)] if expert_index(n) is not None}
                for name in sorted(want - have) + sorted(have - want):
                    e = int(expert_index(name) or 0)
                    path = dirs.get((t, s, min(e // per, ep - 1)), dirs[(t, s, 0)]) / MODEL_FILE
                    local = slots_of_ep_rank(
                        [x for x in slots if x.local == name], ep_rank=e // per, per_rank=per
                    )
                    what = "lacks" if name in want else "holds an unexpected"
                    shown = local[0].local if local else name
                    raise UserError(
                        f"{path}: {what} expert tensor {shown} (global expert {e} of "
                        f"{spec.cfg.num_experts}, EP {ep})"
                    )
