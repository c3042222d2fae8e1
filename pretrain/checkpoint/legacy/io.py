"""Save and load this rank's part of a Megatron-layout checkpoint.

Saving is atomic for the whole checkpoint: all ranks write into ``iter_XXXXXXX.tmp``; after a
barrier, global rank 0 renames it to ``iter_XXXXXXX`` and then updates the tracker file, so a
crash never leaves a half-written iteration marked as latest. ``args`` is the Megatron-named
``argparse.Namespace`` of :func:`pretrain.checkpoint.metadata.to_args` (our typed record inside).
Loading uses ``torch.load(weights_only=True)`` with only ``argparse.Namespace`` allow-listed
besides tensors and plain data; the loaded ``args`` is returned as a plain dict.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pretrain.checkpoint.legacy.layout import (
    CHECKPOINT_VERSION,
    MODEL_FILE,
    flatten,
    iteration_dir,
    rank_dir_name,
    resolve_iteration,
    write_tracker,
)
from pretrain.checkpoint.legacy.module_names import chunk_from_file, chunk_to_file, file_keys
from pretrain.checkpoint.legacy.stream_save import stream_save
from pretrain.checkpoint.metadata import SAFE_GLOBALS, as_mapping, read_metadata, to_args
from pretrain.checkpoint.types import CheckpointMetadata
from pretrain.models.base import ShardedModule
from pretrain.models.lora import has_lora, is_lora_name
from pretrain.parallel.state import ParallelState
from pretrain.utils.atomic import atomic_open
from pretrain.utils.errors import UserError


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def model_state(
    chunks: Sequence[ShardedModule], *, names: str = "legacy", kind: str = "gpt"
) -> dict[str, Any]:
    """``{"model": ...}`` or ``{"model0": ..., "modelV-1": ...}`` for virtual chunks, each under
    ``names`` (see :mod:`pretrain.checkpoint.legacy.module_names`)."""
    entries = [
        chunk_to_file({k: v.detach().cpu() for k, v in _saved_state(c).items()}, names=names, kind=kind)
        for c in chunks
    ]
    return {"model": entries[0]} if len(chunks) == 1 else {f"model{i}": n for i, n in enumerate(entries)}


def _saved_state(chunk: ShardedModule) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of ``chunk``: its state dict, or only the adapter when it has LoRA
    adapters (the frozen base lives in the base checkpoint, see :mod:`pretrain.checkpoint.lora_adapter`)."""
    state = chunk.state_dict()
    return {k: v for k, v in state.items() if is_lora_name(k)} if has_lora(chunk) else state


def rng_state(ps: ParallelState) -> dict[str, Any]:
    """Megatron's ``rng_state`` entry (python, numpy, torch, the TP tracker; CUDA on GPUs)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "random_rng_state": (version, tuple(internal), gauss),
        "np_rng_state": (name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                         float(cached)),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": ps.rng.get_states(),
    }  # fmt: skip
    if torch.cuda.is_available() and ps.device.type == "cuda":
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(ps: ParallelState, state: dict[str, Any]) -> None:
    if "random_rng_state" in state:
        version, internal, gauss = state["random_rng_state"]
        random.setstate((version, tuple(internal), gauss))
    if "np_rng_state" in state:
        name, keys, *rest = state["np_rng_state"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        np.random.set_state((name, keys.astype(np.uint32), *rest))
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and ps.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    ps.rng.set_states(state["rng_tracker_states"])


def rank_dir_of(ps: ParallelState, *, dp_rank: int | None = None) -> str:
    """The directory of this rank's model file (``dp_rank``: of that DP replica's rank at this
    rank's TP/PP coordinates): with expert parallelism one per expert-parallel rank, since
    each holds other experts (``mp_rank_TT[_PPP]_EEE``)."""
    if ps.ep_size == 1:
        return rank_dir_name(ps.tp_rank, ps.pp_rank, ps.pp_size)
    rank = (
        ps.rank
        if dp_rank is None
        else ps.layout.rank_of(tp_rank=ps.tp_rank, dp_rank=dp_rank, pp_rank=ps.pp_rank)
    )
    return rank_dir_name(ps.tp_rank, ps.pp_rank, ps.pp_size, ps.layout.expert_coords(rank)[1])


def writes_rank_dir(ps: ParallelState) -> bool:
    """Whether this rank writes its directory's model file: the lowest DP rank holding the same
    TP/PP shard (and, with expert parallelism, the same experts)."""
    mine = rank_dir_of(ps)
    return next(d for d in range(ps.dp_size) if rank_dir_of(ps, dp_rank=d) == mine) == ps.dp_rank


def save_checkpoint(
    root: str | Path,
    iteration: int,
    chunks: Sequence[ShardedModule],
    ps: ParallelState,
    *,
    args: CheckpointMetadata | Any,
    optimizer: dict[str, Any] | None = None,
    opt_param_scheduler: dict[str, Any] | None = None,
    extra_files: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Write this rank's shard (DP rank 0 writes the model file); collective over all ranks.

    ``extra_files`` maps file names (e.g. ``distrib_optim.pt``) to states this rank writes into
    its ``mp_rank`` directory (callers pass them only on the rank that should write them).
    ``args`` is our record (written as the Megatron-named Namespace at ``iteration``) or an
    already built Namespace.
    """
    meta = args if isinstance(args, CheckpointMetadata) else read_metadata(args)
    if meta is not None:  # iteration and consumed samples as of this save
        args = to_args(meta, iteration=iteration)
    names, kind = (meta.module_names, meta.kind) if meta is not None else ("legacy", "gpt")
    final = iteration_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    rank_dir = tmp / rank_dir_of(ps)
    if writes_rank_dir(ps):
        rank_dir.mkdir(exist_ok=True)
        state = {
            "iteration": iteration,
            "checkpoint_version": CHECKPOINT_VERSION,
            "args": args,
            **model_state(chunks, names=names, kind=kind),
            "optimizer": optimizer,
            "opt_param_scheduler": opt_param_scheduler,
            "rng_state": [rng_state(ps)],
        }
        with atomic_open(rank_dir / MODEL_FILE, "w+b") as fh:  # torch.save's bytes, CRCs by ISA-L
            stream_save(state, fh)
    for name, extra in (extra_files or {}).items():
        rank_dir.mkdir(exist_ok=True)
        with atomic_open(rank_dir / name, "wb") as fh:
            torch.save(extra, fh)
    _barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_tracker(root, iteration)
    _barrier()
    return final


def load_rank_file(path: Path) -> dict[str, Any]:
    """Load one of our checkpoint files safely (tensors and plain data only)."""
    if not path.exists():
        raise UserError(f"missing checkpoint shard {path}")
    try:
        torch.serialization.add_safe_globals(SAFE_GLOBALS)  # (a safe_globals context would drop it on exit)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a corrupt or foreign file: one clear line
        raise UserError(
            f"{path}: cannot be loaded safely ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from None
    if not isinstance(state, dict):
        raise UserError(f"{path}: expected a dict at the top level, found {type(state).__name__}")
    if "args" in state:
        state["args"] = dict(as_mapping(state["args"]))
    return state


def load_checkpoint(
    root: str | Path,
    chunks: Sequence[ShardedModule],
    ps: ParallelState,
    *,
    iteration: int | str | None = None,
) -> dict[str, Any]:
    """Load this rank's model chunks from a checkpoint saved with the same TP/PP/VP layout.

    Returns the file's other entries (``iteration``, ``args``, ``optimizer``,
    ``opt_param_scheduler``, ``rng_state``). Other layouts: reshard with ``mlm-convert reshard``.
    """
    it_dir = resolve_iteration(root, iteration)
    path = it_dir / rank_dir_of(ps) / MODEL_FILE
    state = load_rank_file(path)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks, strict=True):
        if key not in state:
            raise UserError(f"{path}: no {key!r} entry (saved with another virtual-pipeline size?)")
        mine = _saved_state(chunk)
        flat = chunk_from_file(state[key], list(mine))
        missing = set(mine) - set(flat)
        unexpected = set(flatten(state[key])) - file_keys(list(mine))
        if missing or unexpected:
            raise UserError(
                f"{path}: {key} does not match this layout (missing {sorted(missing)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]}); reshard it with mlm-convert reshard"
            )
        for name, param in mine.items():
            if flat[name].shape != param.shape:
                raise UserError(
                    f"{path}: tensor {name} has shape {tuple(flat[name].shape)}, expected {tuple(param.shape)}"
                )
        chunk.load_state_dict(flat, strict=len(mine) == len(chunk.state_dict()))
    return {k: v for k, v in state.items() if not k.startswith("model")}
