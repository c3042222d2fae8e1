"""Training checkpoints: model (Megatron layout), optimizer (full or ZeRO-1 shards), scheduler, RNG.

Non-distributed optimizer: its full state for this (tp, pp) rank's parameters goes into
``model_optim_rng.pt`` (identical on all DP ranks; DP rank 0 writes). Distributed optimizer:
every DP rank's shard is gathered to DP rank 0 and written beside it as ``distrib_optim.pt``
(``{"shards": [...]}`` in DP-rank order, like Megatron's file); ``optimizer`` holds the common
scalars only. Loading accepts either form whatever the optimizer (see :func:`_load_optimizer`), so
runs resume from checkpoints resharded with ``mlm-convert reshard --with-optimizer`` (full form) and
across DP sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pretrain.checkpoint.args import parallel_config_from_args
from pretrain.checkpoint.legacy.io import (
    load_checkpoint,
    load_rank_file,
    rank_dir_of,
    restore_rng_state,
    save_checkpoint,
)
from pretrain.checkpoint.legacy.layout import (
    DISTRIB_OPTIM_FILE,
    MODEL_FILE,
    list_rank_dirs,
    resolve_iteration,
)
from pretrain.checkpoint.lora_adapter import ADAPTER_FILE, LoraBase, adapter_file_entry
from pretrain.checkpoint.metadata import read_metadata
from pretrain.checkpoint.types import CheckpointMetadata
from pretrain.config import ModelConfig
from pretrain.models.base import ShardedModule
from pretrain.models.lora import lora_config_of
from pretrain.optim.distrib_optimizer import DistributedOptimizer, reassemble_full_state
from pretrain.optim.lr_schedule import LRScheduler
from pretrain.optim.optimizer import MixedPrecisionOptimizer
from pretrain.parallel.state import ParallelState
from pretrain.training.config import TrainingConfig
from pretrain.utils.errors import UserError


def _gather_to_dp0(obj: Any, ps: ParallelState) -> list[Any] | None:
    """Collect one object per DP rank on DP rank 0 (collective over the DP group)."""
    if ps.dp_group is None:
        return [obj]
    out: list[Any] | None = [None] * ps.dp_size if ps.dp_rank == 0 else None
    dist.gather_object(obj, out, dst=ps.dp_ranks[0], group=ps.dp_group)
    return out


def save_training_checkpoint(
    root: str | Path, iteration: int, chunks: Sequence[ShardedModule], ps: ParallelState,
    optimizer: MixedPrecisionOptimizer, scheduler: LRScheduler, args: CheckpointMetadata | None, *, lora_base: LoraBase | None = None,
) -> Path:  # fmt: skip
    """Save everything needed to resume; collective over all ranks.

    A model with LoRA adapters needs ``lora_base`` (its base weights' path and fingerprint): the
    rank files then hold only the adapter shards, and the first rank directory the full adapter
    record (:mod:`pretrain.checkpoint.lora_adapter`)."""
    extra: dict[str, dict[str, Any]] = {}
    lora = lora_config_of(chunks[0]) if chunks else None
    if lora is not None:
        if lora_base is None:
            raise ValueError("a LoRA model is saved with lora_base (the base weights' path and fingerprint)")
        entry = adapter_file_entry(chunks, ps, lora=lora, base=lora_base, iteration=iteration)
        if entry is not None:  # global rank 0: the first rank directory
            extra[ADAPTER_FILE] = entry
    if isinstance(optimizer, DistributedOptimizer):
        shards = _gather_to_dp0(optimizer.sharded_state_dict(), ps)
        if ps.dp_rank == 0:
            extra[DISTRIB_OPTIM_FILE] = {"shards": shards}
        opt_state: dict[str, Any] = {"distributed": True, **optimizer.state_dict_common()}
    else:
        opt_state = optimizer.state_dict()
    return save_checkpoint(root, iteration, chunks, ps, args=args, optimizer=opt_state,
                           opt_param_scheduler=scheduler.state_dict(), extra_files=extra)  # fmt: skip


ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_size", "vocab_size",
                       "max_position_embeddings", "num_experts", "moe_router_topk")  # fmt: skip
_NONE_DIFFERS = ("num_experts",)  # None (dense) vs a count is a difference too


def check_architecture(root: str | Path, saved: ModelConfig, here: ModelConfig) -> None:
    """A checkpoint of another model size (or expert count, or top-k: a different function on the
    same tensors) is an architecture mismatch (not a layout one): show both."""
    diff = [(f, getattr(saved, f, None), getattr(here, f, None)) for f in ARCHITECTURE_FIELDS]
    diff = [
        (f, a, b) for f, a, b in diff if a != b and (f in _NONE_DIFFERS or (a is not None and b is not None))
    ]
    if diff:
        both = ", ".join(f"{f.replace('_', '-')} {a} (checkpoint) vs {b} (this run)" for f, a, b in diff)
        raise UserError(f"{root}: the checkpoint's architecture differs from this run's model: {both}")


def check_layout(
    root: str | Path,
    ps: ParallelState,
    it_dir: Path,
    *,
    model_type: str,
    model_cfg: ModelConfig | None = None,
) -> None:
    """Fail with both architectures, or both layouts and the resharding command, when they differ."""
    first = next(iter(list_rank_dirs(it_dir).values()))
    state = load_rank_file(first / MODEL_FILE)
    args = state.get("args") or {}
    saved = parallel_config_from_args(args)
    meta = read_metadata(args, source=str(root))
    kind = meta.kind if meta is not None else args.get("model_type", model_type)
    if kind != model_type:
        raise UserError(f"{root}: checkpoint holds a {kind} model, not {model_type}")
    if meta is not None and model_cfg is not None:
        check_architecture(root, meta.model, model_cfg)
    here = (ps.tp_size, ps.pp_size, ps.vp_size)
    if (saved.tp, saved.pp, saved.vp) != here:
        raise UserError(
            f"{root}: checkpoint was saved with tp={saved.tp} pp={saved.pp} vp={saved.vp}, this run uses "
            f"tp={here[0]} pp={here[1]} vp={here[2]}; reshard it first: mlm-convert reshard --load {root} "
            f"--save NEW_DIR --target-tp {here[0]} --target-pp {here[1]} --target-vp {here[2]}"
        )
    if (saved.ep, saved.expert_tp) != (ps.ep_size, ps.etp_size):
        raise UserError(
            f"{root}: checkpoint was saved with expert parallelism ep={saved.ep} etp={saved.expert_tp}, this "
            f"run uses ep={ps.ep_size} etp={ps.etp_size}; resume with the saved expert layout"
        )


def load_model_weights(root: str | Path, chunks: Sequence[ShardedModule], ps: ParallelState, *,
                       model_type: str) -> dict[str, Any]:  # fmt: skip
    """Load the model chunks (checking the layout first); returns the file's other entries.

    Call before the optimizer is built, so fp16/bf16 runs copy the loaded weights (not the
    random init) into their fp32 main parameters.
    """
    it_dir = resolve_iteration(root, None)
    check_layout(root, ps, it_dir, model_type=model_type, model_cfg=chunks[0].cfg if chunks else None)
    rest = load_checkpoint(root, chunks, ps)
    rest["_iteration_dir"] = str(it_dir)
    return rest


def restore_training_state(rest: dict[str, Any], ps: ParallelState, optimizer: MixedPrecisionOptimizer,
                           scheduler: LRScheduler, cfg: TrainingConfig) -> int:  # fmt: skip
    """Optimizer, scheduler and RNG (unless ``--finetune`` / ``--no-load-*``); the start iteration."""
    if cfg.finetune:
        return 0
    if not cfg.no_load_optim:
        _load_optimizer(Path(rest["_iteration_dir"]), ps, optimizer, rest.get("optimizer"))
        if rest.get("opt_param_scheduler"):
            restore_scheduler(scheduler, rest["opt_param_scheduler"], cfg)
    if not cfg.no_load_rng and rest.get("rng_state"):
        restore_rng_state(ps, rest["rng_state"][0])
    it = rest.get("iteration", 0)
    return 0 if it == "release" else int(it)


def restore_scheduler(scheduler: LRScheduler, state: dict[str, Any], cfg: TrainingConfig) -> None:
    """The saved step count, with this run's schedule or (``--use-checkpoint-opt_param-scheduler``)
    the checkpoint's; a different schedule needs one of the two flags (Megatron's rule)."""
    if cfg.use_checkpoint_opt_param_scheduler:
        saved: dict[str, Any] = {k: state[k] for k in ("lr", "min_lr", "decay_style") if k in state}
        unit = "samples" if state.get("by_samples") else "iters"
        other = "iters" if unit == "samples" else "samples"
        saved.update({f"warmup_{other}": 0, f"decay_{other}": None})
        if "warmup_steps" in state:
            saved[f"warmup_{unit}"] = state["warmup_steps"]
        if "decay_steps" in state:
            saved[f"decay_{unit}"] = state["decay_steps"]
        scheduler.config = dataclasses.replace(scheduler.config, **saved)
    try:
        scheduler.load_state_dict(state, override=cfg.override_opt_param_scheduler)
    except UserError as exc:
        raise UserError(
            str(exc).split(" (pass")[0]
            + "; resume with --override-opt_param-scheduler (this run's LR flags) "
            "or --use-checkpoint-opt_param-scheduler (the checkpoint's schedule)"
        ) from None


def _load_optimizer(it_dir: Path, ps: ParallelState, optimizer: MixedPrecisionOptimizer, state: Any) -> None:
    """Restore the optimizer from either form: ``distrib_optim.pt`` shards or the full state.

    A distributed optimizer takes its own shard when the DP size matches, else its element ranges
    of the full state (``mlm-convert reshard --with-optimizer`` writes the full form); a
    non-distributed optimizer reassembles ``distrib_optim.pt`` shards into the full form."""
    rank_dir = it_dir / rank_dir_of(ps, dp_rank=0)  # DP rank 0 gathered the ZeRO-1 shards
    path = rank_dir / DISTRIB_OPTIM_FILE
    shards = (load_rank_file(path).get("shards") or []) if path.exists() else None
    if isinstance(optimizer, DistributedOptimizer) and shards is not None and len(shards) == ps.dp_size:
        optimizer.load_sharded_state_dict(shards[ps.dp_rank])
        return
    if shards is not None:
        try:
            state = reassemble_full_state(shards, ep_rank=ps.ep_rank)  # this rank's experts
        except (ValueError, KeyError, IndexError) as exc:
            raise UserError(f"{path}: cannot reassemble the optimizer shards ({exc})") from None
    if not isinstance(state, dict) or "params" not in state:
        raise UserError(
            f"{rank_dir / MODEL_FILE}: no optimizer state (neither {DISTRIB_OPTIM_FILE} nor a full "
            "'optimizer' entry); use --no-load-optim"
        )
    try:
        if isinstance(optimizer, DistributedOptimizer):
            optimizer.load_full_state_dict(state)
        else:
            optimizer.load_state_dict(state)
    except (KeyError, ValueError) as exc:
        raise UserError(f"{rank_dir}: the optimizer state does not fit this model ({exc})") from None
