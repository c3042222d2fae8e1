"""Optimizer state as canonical full tensors, and its megatron-core ``torch_dist`` form.

Every optimizer state tensor is shaped like its parameter, so a source of optimizer state is, like
a :class:`~pretrain.checkpoint.types.TensorSource` of weights, "full tensor by canonical name"
(:class:`OptimizerSource`), one tensor per state kind (:data:`OPTIM_STATES`: the fp32 main
``param``, ``exp_avg``, ``exp_avg_sq``), plus the non-tensor part (:class:`OptimizerCommon`: the
Adam step, the hyperparameters per group, the loss scaler) and the LR schedule. Readers of our
per-rank files and of ``torch_dist`` yield it; writers of both consume it, so optimizer state
crosses layouts and formats exactly like the weights.

megatron-core's ``torch_dist`` form (what ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params``
``.sharded_state_dict`` and the distributed optimizer's model-space formats store): tensors
``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<model key>`` with the model tensor's global
shape and chunks (``fully_reshardable`` distributed-optimizer saves name the main param ``param``);
``common.pt["optimizer"]`` holds ``{"state": {"common_step": step}, "param_groups": [...]}``,
nested under ``"optimizer"`` (with ``"grad_scaler"`` beside it) for mixed precision; and
``common.pt["opt_param_scheduler"]`` counts samples (Megatron-LM steps it by the global batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pretrain.utils.errors import UserError

OPTIM_STATES = ("param", "exp_avg", "exp_avg_sq")
# our state kind -> megatron-core's names for it in torch_dist keys (first: what we write)
MCORE_STATE_NAMES = {"param": ("fp32_param", "param"), "exp_avg": ("exp_avg",), "exp_avg_sq": ("exp_avg_sq",)}
MCORE_STATE_PREFIX = "optimizer.state"
# The torch AdamW hyperparameters one of our groups carries (what a resume restores).
_HYPER = ("lr", "betas", "eps", "weight_decay")
# Layout-bound distributed-optimizer formats: raw per-DP-rank buffers, not per-parameter tensors.
_LAYOUT_BOUND = ("dp_reshardable", "dp_zero_gather_scatter", "fully_sharded_bucket_space", "fsdp_dtensor")


@dataclass(frozen=True, kw_only=True)
class OptimizerCommon:
    """The non-tensor optimizer state: Adam's step count, per-group hyperparameters (our groups:
    ``[decay, no_decay]``, the empty one left out) and the loss scaler's state (fp16 only)."""

    step: int
    param_groups: tuple[dict[str, Any], ...]
    grad_scaler: dict[str, Any] | None = None

    def essentials(self) -> tuple[Any, ...]:
        """What a resume restores (step, per-group lr/betas/eps/weight decay, loss scale): equal
        for two records of the same state in any format."""
        groups = tuple(tuple((k, tuple(g[k]) if k == "betas" else g[k]) for k in _HYPER if k in g)
                       for g in self.param_groups)  # fmt: skip
        scale = None if self.grad_scaler is None else float(self.grad_scaler.get("scale", 0.0))
        return self.step, groups, scale

    def as_ours(self) -> dict[str, Any]:
        """The ``step`` / ``param_groups`` / ``grad_scaler`` entries of our optimizer state dict."""
        return {"step": self.step, "param_groups": [dict(g) for g in self.param_groups],
                "grad_scaler": self.grad_scaler}  # fmt: skip


class OptimizerSource(Protocol):
    """Optimizer state as canonical full fp32 tensors (the same names as the weights)."""

    common: OptimizerCommon
    scheduler: dict[str, Any] | None  # our LR-schedule state (see pretrain.optim.lr_schedule)
    global_batch_size: int | None  # samples per iteration of the run (Megatron's schedule counts samples)

    def state(self, kind: str, canonical: str) -> torch.Tensor: ...

    def state_stored_rows(self, kind: str, canonical: str) -> torch.Tensor:
        """:meth:`state` with every stored row (a vocabulary tensor's padding rows included)."""
        ...


def _mcore_group(ours: dict[str, Any], *, decay: bool, min_lr: float) -> dict[str, Any]:
    """One of our groups as megatron-core's ``_get_param_groups`` + torch ``AdamW`` group."""
    return {
        "is_expert_parallel": False, "default_config": True, "wd_mult": 1.0 if decay else 0.0,
        "lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": ours["lr"], "min_lr": min_lr,
        "lr": ours["lr"], "betas": tuple(ours["betas"]), "eps": ours["eps"],
        "weight_decay": ours["weight_decay"], "amsgrad": False, "maximize": False, "foreach": None,
        "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
    }  # fmt: skip


def to_mcore_common(common: OptimizerCommon, *, mixed_precision: bool, min_lr: float) -> dict[str, Any]:
    """``common.pt["optimizer"]`` as megatron-core's non-distributed optimizers save it.

    Our groups are ``[decay, no_decay]``; megatron-core orders its groups the same way
    (``wd_mult`` 1.0 before the 0.0 override) and matches them by ``wd_mult`` on load. A single
    group is the decay group if it has weight decay."""
    groups = list(common.param_groups)
    decays = [True, False] if len(groups) == 2 else [groups[0]["weight_decay"] > 0] if groups else []
    inner = {
        "state": {"common_step": torch.tensor(float(common.step))},
        "param_groups": [
            _mcore_group(g, decay=d, min_lr=min_lr) for g, d in zip(groups, decays, strict=True)
        ],
    }
    if not mixed_precision:
        return inner
    out: dict[str, Any] = {"optimizer": inner}
    if common.grad_scaler is not None:
        scaler = dict(common.grad_scaler)
        scaler["scale"] = torch.tensor([float(scaler["scale"])])
        out["grad_scaler"] = scaler
    return out


def to_mcore_distributed_common(common: OptimizerCommon, *, min_lr: float) -> dict[str, Any]:
    """``common.pt["optimizer"]`` as megatron-core's ``DistributedOptimizer`` saves it in the
    ``fully_reshardable`` format (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``): the
    groups without params, each with the step (torch's optimizers keep it per group there)."""
    inner = to_mcore_common(common, mixed_precision=False, min_lr=min_lr)
    groups = [{**g, "step": float(common.step)} for g in inner["param_groups"]]
    out: dict[str, Any] = {
        "optimizer": {"param_groups": groups},
        "param_state_sharding_type": "fully_reshardable",
    }
    if common.grad_scaler is not None:
        out["grad_scaler"] = {
            **common.grad_scaler,
            "scale": torch.tensor([float(common.grad_scaler["scale"])]),
        }
    return out


def from_mcore_common(entry: Any, *, source: str) -> OptimizerCommon:
    """:class:`OptimizerCommon` of a megatron-core ``common.pt["optimizer"]`` (any optimizer)."""
    if not isinstance(entry, dict):
        raise UserError(f"{source}: common.pt has no 'optimizer' entry (saved without optimizer state?)")
    kind = entry.get("param_state_sharding_type")
    if kind in _LAYOUT_BOUND:
        raise UserError(
            f"{source}: optimizer state is distributed-optimizer {kind!r} (raw per-DP-rank buffers "
            "bound to the saving layout); re-save it from Megatron-LM with "
            "--dist-ckpt-optim-fully-reshardable, or convert without --with-optimizer"
        )
    inner = entry.get("optimizer", entry)
    if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
        raise UserError(f"{source}: common.pt 'optimizer' has no param_groups (unknown optimizer format)")
    groups = sorted(inner["param_groups"], key=lambda g: -float(g.get("wd_mult", 1.0)))
    step = (inner.get("state") or {}).get("common_step")
    if step is None:  # the distributed optimizer keeps the step in its groups
        step = next((g["step"] for g in groups if g.get("step") is not None), None)
    if step is None:
        raise UserError(
            f"{source}: common.pt 'optimizer' has no state.common_step (optimizer never stepped?)"
        )
    scaler = entry.get("grad_scaler") if "optimizer" in entry else None
    if isinstance(scaler, dict) and "scale" in scaler:
        scaler = {**scaler, "scale": float(torch.as_tensor(scaler["scale"]).reshape(-1)[0])}
    return OptimizerCommon(
        step=int(torch.as_tensor(step).item()),
        param_groups=tuple({k: g[k] for k in _HYPER if k in g} for g in groups),
        grad_scaler=scaler if isinstance(scaler, dict) else None,
    )


def to_mcore_scheduler(ours: dict[str, Any] | None, *, global_batch_size: int | None,
                       weight_decay: float) -> dict[str, Any] | None:  # fmt: skip
    """Our LR-schedule state as megatron-core's ``OptimizerParamScheduler.state_dict`` (samples)."""
    if not ours:
        return None
    scale = 1
    if not ours.get("by_samples"):
        if not global_batch_size:
            raise UserError(
                "--with-optimizer: the LR schedule counts iterations but the checkpoint does not record "
                "the global batch size Megatron-LM needs to count samples"
            )
        scale = global_batch_size
    decay = ours.get("decay_steps")
    return {
        "max_lr": ours["lr"], "lr_warmup_steps": int(ours.get("warmup_steps") or 0) * scale,
        "num_steps": int(ours["num_steps"]) * scale, "lr_decay_style": ours.get("decay_style", "linear"),
        "lr_decay_steps": None if decay is None else int(decay) * scale, "min_lr": ours.get("min_lr", 0.0),
        "start_wd": weight_decay, "end_wd": weight_decay, "wd_incr_style": "constant",
        "wd_incr_steps": None if decay is None else int(decay) * scale,
    }  # fmt: skip


def from_mcore_scheduler(state: Any, *, global_batch_size: int | None) -> dict[str, Any] | None:
    """megatron-core's scheduler state as ours: in iterations when every count divides by the
    global batch size (a plain Megatron-LM run), else in samples."""
    if not isinstance(state, dict) or "num_steps" not in state:
        return None
    counts = [state.get(k) for k in ("num_steps", "lr_warmup_steps", "lr_decay_steps")]
    gbs = global_batch_size or 0
    by_iters = gbs > 0 and all(c is None or int(c) % gbs == 0 for c in counts)
    div = gbs if by_iters else 1
    num, warm, decay = (None if c is None else int(c) // div for c in counts)
    return {
        "lr": state.get("max_lr"), "min_lr": state.get("min_lr", 0.0),
        "decay_style": state.get("lr_decay_style", "linear"), "warmup_steps": warm or 0,
        "decay_steps": decay, "by_samples": not by_iters, "num_steps": num,
    }  # fmt: skip


def mcore_state_keys(kind: str, model_key: str) -> tuple[str, ...]:
    """The torch_dist keys under which megatron-core may store state ``kind`` of ``model_key``."""
    return tuple(f"{MCORE_STATE_PREFIX}.{name}.{model_key}" for name in MCORE_STATE_NAMES[kind])
