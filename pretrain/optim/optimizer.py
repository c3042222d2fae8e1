"""Mixed-precision AdamW over the data-parallel gradient buffers (Megatron-LM's Float16Optimizer).

Per trainable parameter the optimizer keeps a :class:`MainParam`: the fp32 tensor Adam steps
(the model parameter itself when it is fp32, else an fp32 copy) and its fp32 gradient (a view of
the fp32 grad buffer, or an fp32 copy when the buffer holds fp16/bf16 grads). One
:meth:`MixedPrecisionOptimizer.step`:

1. copy model grads into fp32 main grads (only where the grad buffer is not fp32);
2. with a loss scaler: unscale, check for inf/nan, agree on the flag (all-reduce MAX over the DP
   and model-parallel groups), update the scale, and on overflow return without touching any
   parameter or optimizer state;
3. global grad norm (model-parallel group; see :mod:`pretrain.optim.clip_grads`) and clipping;
4. AdamW step on the main params (torch fused/foreach; apex FusedAdam if importable on CUDA);
5. copy main params back into the model params (:class:`DistributedOptimizer` also all-gathers).

The training step order: ``zero_grad()`` (zeroes the DDP buffers), forward/backward of every
microbatch on ``scale_loss(loss)``, ``finalize_model_grads`` (DP sync + embedding sync), then
``update_successful, grad_norm, num_zeros = optimizer.step()``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pretrain.distributed.ddp import DistributedDataParallel
from pretrain.optim.clip_grads import (
    clip_grads_by_norm,
    count_zeros,
    counts_for_norm,
    expert_groups_differ,
    global_grad_norm,
)
from pretrain.optim.config import OptimizerConfig
from pretrain.optim.loss_scaler import LossScaler, build_loss_scaler
from pretrain.optim.param_groups import uses_weight_decay
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.layers import is_expert
from pretrain.utils.errors import UserError

_DEFAULT_SCALER: Any = object()


@dataclass(eq=False)
class MainParam:
    """One fp32 tensor stepped by Adam and where it comes from.

    ``model_view``: the part of the model parameter it updates (same shape as ``main``);
    ``model_grad``: the matching part of ``param.main_grad``; ``grad``: the fp32 gradient Adam
    reads (``model_grad`` itself when that is fp32).
    """

    key: str
    model_param: nn.Parameter
    main: torch.Tensor
    model_view: torch.Tensor
    model_grad: torch.Tensor
    grad: torch.Tensor
    decay: bool
    counted: bool

    @property
    def copies_param(self) -> bool:
        return self.main is not self.model_view

    @property
    def copies_grad(self) -> bool:
        return self.grad is not self.model_grad


def make_main_param(
    key: str,
    param: nn.Parameter,
    model_view: torch.Tensor,
    model_grad: torch.Tensor,
    *,
    decay: bool,
    counted: bool,
) -> MainParam:
    """fp32 main tensors for ``model_view``/``model_grad``, sharing memory where already fp32."""
    main = model_view if model_view.dtype == torch.float32 else model_view.detach().float().clone()
    grad = (
        model_grad if model_grad.dtype == torch.float32 else torch.zeros_like(model_grad, dtype=torch.float32)
    )
    return MainParam(key, param, main, model_view, model_grad, grad, decay, counted)


def _make_adam(config: OptimizerConfig, mains: Sequence[MainParam]) -> torch.optim.Optimizer:
    groups = [
        {"params": [m.main for m in mains if m.decay], "weight_decay": config.weight_decay},
        {"params": [m.main for m in mains if not m.decay], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    kw: dict[str, Any] = {
        "lr": config.lr,
        "betas": (config.adam_beta1, config.adam_beta2),
        "eps": config.adam_eps,
    }
    on_cuda = bool(mains) and mains[0].main.is_cuda
    if config.use_apex_adam and on_cuda:
        try:  # optional dependency, never required
            from apex.optimizers import FusedAdam  # type: ignore[import-not-found]

            return FusedAdam(groups, adam_w_mode=True, **kw)
        except ImportError:
            pass
    return torch.optim.AdamW(groups, fused=True if on_cuda else None, foreach=None if on_cuda else True, **kw)


def _init_adam_state(adam: torch.optim.Optimizer) -> None:
    """Allocate Adam state up front (as torch would on the first step) so memory and per-shard
    state exist before any step, and skipped first steps leave well-defined state."""
    if not isinstance(adam, torch.optim.AdamW):
        return
    for group in adam.param_groups:
        for p in group["params"]:
            on_device = group.get("fused") or group.get("capturable")
            adam.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }


class MixedPrecisionOptimizer:
    """AdamW with fp32 main params/grads, loss scaling and global-norm clipping (no sharding)."""

    def __init__(
        self,
        config: OptimizerConfig,
        ddps: Sequence[DistributedDataParallel],
        ps: ParallelState,
        *,
        scaler: LossScaler | None = _DEFAULT_SCALER,
    ) -> None:
        self.config, self.ddps, self.ps = config, list(ddps), ps
        self._check(config, self.ddps)
        self.scaler = build_loss_scaler(config) if scaler is _DEFAULT_SCALER else scaler
        self.mains = self._build_mains()
        self.adam = _make_adam(config, self.mains)
        _init_adam_state(self.adam)

    @staticmethod
    def _check(config: OptimizerConfig, ddps: Sequence[DistributedDataParallel]) -> None:
        for d in ddps:
            if d.config.use_distributed_optimizer != config.use_distributed_optimizer:
                raise UserError(
                    "use_distributed_optimizer differs between the optimizer config and the DDP config"
                )
            for p in d.module.parameters():
                if p.requires_grad and p.dtype != config.params_dtype:
                    raise UserError(
                        f"model parameters are {p.dtype} but the optimizer config expects "
                        f"{config.params_dtype} (check --fp16/--bf16 against params_dtype)"
                    )

    def _named_params(self) -> list[tuple[str, str, nn.Parameter]]:
        """``(key, local name, param)`` of every trainable parameter; key = ``model{i}.{name}``."""
        return [
            (f"model{i}.{name}", name, p)
            for i, d in enumerate(self.ddps)
            for name, p in d.module.named_parameters()
            if p.requires_grad
        ]

    def _build_mains(self) -> list[MainParam]:
        return [
            make_main_param(
                key,
                p,
                p.data,
                p.main_grad,  # type: ignore[attr-defined]
                decay=uses_weight_decay(name, p),
                counted=counts_for_norm(name, p, self.ps),
            )
            for key, name, p in self._named_params()
        ]

    # --- groups -------------------------------------------------------------------------------
    def _norm_groups(self) -> list[dist.ProcessGroup | None]:
        """Groups over which this rank's gradients are disjoint pieces of the global norm."""
        return [self.ps.mp_group]

    def _expert_norm_groups(self) -> list[dist.ProcessGroup | None]:
        """The same for routed experts' gradients (used when the expert groups differ)."""
        return [self.ps.expert_mp_group]

    def _overflow_groups(self) -> list[dist.ProcessGroup | None]:
        return [self.ps.dp_group, self.ps.mp_group]

    # --- public API -----------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (unchanged without a loss scaler); call backward on the result."""
        return loss if self.scaler is None else loss * self.scaler.scale

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.scaler is None else self.scaler.scale

    def zero_grad(self) -> None:
        """Zero every chunk's gradient buffers (call before the first microbatch)."""
        for d in self.ddps:
            d.zero_grad_buffer()

    def set_lr(self, lr: float) -> None:
        for group in self.adam.param_groups:
            group["lr"] = lr

    def get_lr(self) -> float:
        return float(self.adam.param_groups[0]["lr"])

    def _found_inf(self) -> bool:
        """Unscale the fp32 grads in place; True if any rank saw inf/nan (MAX over DP and MP)."""
        assert self.scaler is not None
        found = torch.zeros(1, dtype=torch.float32, device=self.ps.device)
        grads = [m.grad for m in self.mains]
        inv = torch.full((1,), self.scaler.inv_scale, dtype=torch.float32, device=self.ps.device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        for g in self._overflow_groups():
            if g is not None:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=g)
        return bool(found.item() > 0)

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        """One optimizer step; returns ``(update_successful, grad_norm, num_zeros_in_grad)``.

        ``grad_norm`` is the global norm before clipping (None on a skipped step);
        ``num_zeros_in_grad`` is None unless ``config.log_num_zeros_in_grad``.
        """
        for m in self.mains:
            if m.copies_grad:
                m.grad.copy_(m.model_grad)
        if self.scaler is not None:
            found_inf = self._found_inf()
            self.scaler.update(found_inf)
            if found_inf:
                return False, None, None
        norm, zeros = self._norm_and_zeros()
        if self.config.clip_grad > 0:
            clip_grads_by_norm([m.grad for m in self.mains], max_norm=self.config.clip_grad, total_norm=norm)
        for m in self.mains:
            m.main.grad = m.grad
        self.adam.step()
        for m in self.mains:
            m.main.grad = None  # model grads must never alias the buffer during backward
        self._copy_main_to_model()
        return True, norm, zeros

    def _norm_and_zeros(self) -> tuple[float, int | None]:
        """Global grad norm (and zero count if logged) of the counted grads: dense and routed
        experts over their own groups when those differ (:func:`expert_groups_differ`)."""
        counted = [m for m in self.mains if m.counted]
        parts = [([m.grad for m in counted], self._norm_groups())]
        if expert_groups_differ(self.ps):
            parts = [
                ([m.grad for m in counted if not is_expert(m.model_param)], self._norm_groups()),
                ([m.grad for m in counted if is_expert(m.model_param)], self._expert_norm_groups()),
            ]
        norm_type = self.config.clip_norm_type
        norms = [global_grad_norm(g, norm_type=norm_type, groups=groups) for g, groups in parts]
        norm = max(norms) if norm_type == math.inf else math.sqrt(sum(n * n for n in norms))
        if not self.config.log_num_zeros_in_grad:
            return norm, None
        return norm, sum(count_zeros(g, groups=groups) for g, groups in parts)

    def _copy_main_to_model(self) -> None:
        for m in self.mains:
            if m.copies_param:
                m.model_view.copy_(m.main)

    # --- state ----------------------------------------------------------------------------------
    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{key: {"param", "exp_avg", "exp_avg_sq"}}`` fp32 tensors shaped like the parameter."""
        out = {}
        for m in self.mains:
            state = self.adam.state[m.main]
            out[m.key] = {
                "param": m.main.detach().clone(),
                "exp_avg": state["exp_avg"].clone(),
                "exp_avg_sq": state["exp_avg_sq"].clone(),
            }
        return out

    def adam_step_count(self) -> int:
        states = [self.adam.state[m.main] for m in self.mains if m.main in self.adam.state]
        return int(states[0]["step"]) if states else 0

    def state_dict(self) -> dict[str, Any]:
        """Full (non-sharded) state: main params, Adam moments, step, lr, loss scaler."""
        return {
            "params": self.full_state(),
            "step": self.adam_step_count(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.adam.param_groups],
            "grad_scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = state["params"]
        missing = [m.key for m in self.mains if m.key not in params]
        if missing:
            raise KeyError(f"optimizer state has no entry for {missing[:3]}")
        for m in self.mains:
            entry = params[m.key]
            self._load_main(m, entry["param"], entry["exp_avg"], entry["exp_avg_sq"], state["step"])
        self._load_common(state)
        self._copy_main_to_model()

    def _load_main(
        self, m: MainParam, param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int
    ) -> None:
        m.main.copy_(param.view_as(m.main))
        st = self.adam.state[m.main]
        st["exp_avg"].copy_(exp_avg.view_as(m.main))
        st["exp_avg_sq"].copy_(exp_avg_sq.view_as(m.main))
        st["step"].fill_(float(step))

    def _load_common(self, state: dict[str, Any]) -> None:
        for group, saved in zip(self.adam.param_groups, state["param_groups"], strict=True):
            group.update(saved)
        if self.scaler is not None and state.get("grad_scaler") is not None:
            self.scaler.load_state_dict(state["grad_scaler"])

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of tensors the optimizer allocated: fp32 param copies, fp32 grad copies, Adam state."""

        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        state = sum(nbytes(t) for st in self.adam.state.values() for t in st.values() if torch.is_tensor(t))
        return {
            "main_params": sum(nbytes(m.main) for m in self.mains if m.copies_param),
            "main_grads": sum(nbytes(m.grad) for m in self.mains if m.copies_grad),
            "optimizer_state": state,
        }
