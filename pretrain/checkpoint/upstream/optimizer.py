"""Name the optimizer state of an upstream megatron-core legacy ``torch`` file.

Megatron-LM's legacy save (``--ckpt-format torch``) stores ``optimizer.state_dict()`` in each rank
file: torch's form, keyed by parameter *position* (``{"state": {i: {"step", "exp_avg",
"exp_avg_sq"}}, "param_groups": [{..., "params": [i, ...]}]}``), wrapped as ``{"optimizer": ...,
"fp32_from_fp16_params": [[fp32 main per param] per group], "grad_scaler"}`` by the mixed-precision
optimizer. The positions follow megatron-core's ``_get_param_groups``: the groups in order (no
override, i.e. weight decay, first; then ``wd_mult`` 0: biases and 1-D tensors), each listing its
parameters in ``named_parameters`` order over the model chunks, which is the order of the
``model``/``model{i}`` state dicts in the same file (``_extra_state`` entries aside). So the names
come from the file itself; the group sizes and every tensor's size are checked against them, and
anything that does not line up is refused with one line (other eras order their groups otherwise).
The distributed optimizer's ``distrib_optim.pt`` buffers are bound to the saving layout: refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pretrain.utils.errors import UserError


@dataclass(frozen=True)
class UpstreamParam:
    """One parameter of a rank file, in the file's order: our optimizer key and its weight."""

    key: str  # "model{c}.{local name}", as our optimizer state names it
    file_key: str
    weight: torch.Tensor

    @property
    def decays(self) -> bool:
        """megatron-core's default: no weight decay on biases and 1-D tensors."""
        return not (self.file_key.endswith(".bias") or self.weight.dim() == 1)


def _position_order(params: Sequence[UpstreamParam]) -> list[UpstreamParam]:
    return [p for p in params if p.decays] + [p for p in params if not p.decays]


def _check_groups(groups: list[dict[str, Any]], params: Sequence[UpstreamParam], source: str) -> None:
    sizes = [len(g.get("params", ())) for g in groups]
    want = [n for n in (sum(p.decays for p in params), sum(not p.decays for p in params)) if n]
    if sizes != want:
        raise UserError(
            f"{source}: optimizer groups hold {sizes} parameters, megatron-core's order gives {want} "
            "(a Megatron-LM version with other parameter groups); save with --ckpt-format torch_dist"
        )


def upstream_full_state(entry: Any, params: Sequence[UpstreamParam], *, source: str) -> dict[str, Any]:
    """Our full optimizer form (``{"params": {key: {"param", "exp_avg", "exp_avg_sq"}}, "step",
    "param_groups", "grad_scaler"}``) of a megatron-core ``optimizer`` entry of one rank file."""
    if isinstance(entry, list):
        raise UserError(f"{source}: a chained optimizer state (several optimizers) is not read")
    mixed = isinstance(entry, dict) and "fp32_from_fp16_params" in entry
    inner = entry.get("optimizer") if mixed else entry
    if (
        not isinstance(inner, dict)
        or not isinstance(inner.get("state"), dict)
        or not inner.get("param_groups")
    ):
        raise UserError(f"{source}: 'optimizer' is not a torch optimizer state (no state / param_groups)")
    groups = list(inner["param_groups"])
    _check_groups(groups, params, source)
    ordered = _position_order(params)
    mains = [t for group in entry["fp32_from_fp16_params"] for t in group] if mixed else None
    out: dict[str, dict[str, torch.Tensor]] = {}
    steps = set()
    for i, p in enumerate(ordered):
        st = inner["state"].get(i)
        if not st:
            raise UserError(f"{source}: optimizer state has no entry for parameter {i} ({p.file_key})")
        main = mains[i] if mains is not None else p.weight
        for kind, t in (("param", main), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"])):
            if t.numel() != p.weight.numel():
                raise UserError(
                    f"{source}: optimizer {kind} of parameter {i} has {t.numel()} elements, "
                    f"{p.file_key} has {p.weight.numel()} (parameter order differs from megatron-core's)"
                )
        out[p.key] = {
            "param": main.float().view_as(p.weight),
            "exp_avg": st["exp_avg"].float().view_as(p.weight),
            "exp_avg_sq": st["exp_avg_sq"].float().view_as(p.weight),
        }
        steps.add(int(torch.as_tensor(st["step"]).item()))
    if len(steps) != 1:
        raise UserError(f"{source}: optimizer steps differ between parameters ({sorted(steps)[:4]})")
    scaler = entry.get("grad_scaler") if mixed else None
    if isinstance(scaler, dict) and "scale" in scaler:
        scaler = {**scaler, "scale": float(torch.as_tensor(scaler["scale"]).reshape(-1)[0])}
    hyper = [{k: v for k, v in g.items() if k in ("lr", "betas", "eps", "weight_decay")} for g in groups]
    return {"params": out, "step": steps.pop(), "param_groups": hyper,
            "grad_scaler": scaler if isinstance(scaler, dict) else None}  # fmt: skip
