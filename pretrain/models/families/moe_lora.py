"""Canonical LoRA adapter tensors <-> a Hugging Face PEFT LoRA adapter of a mixture-of-experts model
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), exact both ways. A pure name/tensor mapping (no ``peft``).

transformers 5 holds the routed experts of a layer as two fused parameters of
``model.layers.{i}.mlp.experts`` (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), which PEFT
0.21 adapts with ``target_parameters`` (its ``ParamWrapper``). For a 3-D parameter it holds
``lora_A [E r, in]`` (rows ``[e r, (e+1) r)``: expert ``e``'s ``A``) and ``lora_B [out, r E]``
whose column ``k E + e`` is column ``k`` of expert ``e``'s ``B`` (``reshape(out, r, E)``), with
scaling ``alpha / r``: one rank-``r`` LoRA per expert, which is exactly ours
(:mod:`pretrain.models.lora_experts`). Both parameters of one module are wrapped in turn, in the
order the module registers them, so with both targeted the state dict names ``gate_up_proj``'s
pair ``mlp.experts.base_layer.lora_A.weight`` and ``down_proj``'s ``mlp.experts.lora_A.weight``;
with one targeted, that one is ``mlp.experts.lora_A.weight``.

Attention, the dense MLP of Qwen's ``mlp_only_layers`` and Qwen2-MoE's shared expert
(``mlp.shared_expert.gate_proj``...) are plain linears: :mod:`pretrain.models.families.llama_lora`
maps them (q/k/v and gate/up split by slice). The router is never adapted.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pretrain.config import ModelConfig
from pretrain.models.families.llama import LM
from pretrain.models.families.llama_lora import (
    HF_MODULES,
    PEFT_PREFIX,
    check_all_read,
    pair_from_peft,
    pair_to_peft,
)
from pretrain.models.lora import ALL_TARGETS, TARGET_MODULES, adapter_names
from pretrain.utils.errors import UserError

# our target -> transformers' fused expert parameter (PEFT target_parameters) it becomes
EXPERT_PARAMETERS: dict[str, str] = {"fc1": "experts.gate_up_proj", "fc2": "experts.down_proj"}


def has_plain_mlps(cfg: ModelConfig) -> bool:
    """Whether the model has MLPs made of HF linears: a dense layer or a shared expert."""
    dense = any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    return dense or cfg.moe_shared_expert_intermediate_size is not None


def peft_targets(cfg: ModelConfig, targets: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """PEFT ``target_modules`` and ``target_parameters`` of our ``targets`` on model ``cfg``."""
    modules = [
        m.rsplit(".", 1)[1]
        for t in targets
        for m in HF_MODULES[t]
        if t in ("qkv", "proj") or has_plain_mlps(cfg)
    ]
    return modules, [EXPERT_PARAMETERS[t] for t in ("fc1", "fc2") if t in targets]


def targets_of_peft(
    cfg: ModelConfig, modules: list[str], parameters: list[str], *, where: str
) -> tuple[str, ...]:
    """Our targets from PEFT ``target_modules`` and ``target_parameters``: a target's HF modules
    and fused expert parameter come all or none (``UserError`` naming ``where`` otherwise)."""
    given = {f"module {m.rsplit('.', 1)[-1]}" for m in modules}
    given |= {f"parameter experts.{p.rsplit('.', 1)[-1]}" for p in parameters}
    need = {t: _needs(cfg, t) for t in ALL_TARGETS}
    unknown = given - set().union(*need.values())
    if unknown:
        raise UserError(f"{where}: {sorted(unknown)} are not linears or expert parameters we adapt")
    out = []
    for target in ALL_TARGETS:
        have = need[target] & given
        if have and have != need[target]:
            raise UserError(
                f"{where}: {sorted(have)} without {sorted(need[target] - have)}; our {target} adapter "
                f"covers all of {sorted(need[target])} (target_modules / target_parameters)"
            )
        if have:
            out.append(target)
    if not out:
        raise UserError(f"{where}: no target_modules or target_parameters we adapt")
    return tuple(out)


def _needs(cfg: ModelConfig, target: str) -> set[str]:
    """The PEFT targets (``module x`` / ``parameter experts.x``) that make our ``target``."""
    modules, parameters = peft_targets(cfg, (target,))
    return {f"module {m}" for m in modules} | {f"parameter {p}" for p in parameters}


def _expert_keys(i: int, target: str, targets: tuple[str, ...]) -> str:
    """The PEFT module stem of layer ``i``'s fused expert parameter of ``target``."""
    nested = target == "fc1" and "fc2" in targets  # down_proj's wrapper holds gate_up_proj's
    return f"{PEFT_PREFIX}model.layers.{i}.mlp.experts" + (".base_layer" if nested else "")


def _ours(i: int, module: str) -> str:
    return f"{LM}encoder.layers.{i}.{module}.weight"


def _plain_pairs(cfg: ModelConfig, i: int, target: str) -> list[tuple[str, list[str]]]:
    """(our base weight, its HF modules) of layer ``i``'s plain linears of ``target``."""
    hf = f"{PEFT_PREFIX}model.layers.{i}."
    if target in ("qkv", "proj") or not cfg.is_moe_layer(i):
        return [(_ours(i, TARGET_MODULES[target]), [hf + m for m in HF_MODULES[target]])]
    if cfg.moe_shared_expert_intermediate_size is None:
        return []
    sub = "dense_h_to_4h" if target == "fc1" else "dense_4h_to_h"
    names = [m.rsplit(".", 1)[1] for m in HF_MODULES[target]]
    return [(_ours(i, f"mlp.shared_experts.{sub}"), [f"{hf}mlp.shared_expert.{n}" for n in names])]


def _routed(cfg: ModelConfig, i: int, target: str) -> list[str]:
    sub = "dense_h_to_4h" if target == "fc1" else "dense_4h_to_h"
    return [_ours(i, f"mlp.experts.{e}.{sub}") for e in range(int(cfg.num_experts or 0))]


def canonical_to_peft(
    adapters: Mapping[str, torch.Tensor], cfg: ModelConfig, targets: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """Our full adapter tensors -> a PEFT ``adapter_model`` state dict (contiguous copies)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        for target in targets:
            for ours, hf in _plain_pairs(cfg, i, target):
                out.update(pair_to_peft(adapters, ours, hf, target, cfg))
            if target in EXPERT_PARAMETERS and cfg.is_moe_layer(i):
                names = [adapter_names(n) for n in _routed(cfg, i, target)]
                missing = [n for pair in names for n in pair if n not in adapters]
                if missing:
                    raise UserError(f"LoRA -> PEFT: missing adapter tensor {missing[0]}")
                stem = _expert_keys(i, target, targets)
                out[f"{stem}.lora_A.weight"] = torch.cat([adapters[a] for a, _ in names]).contiguous()
                b = torch.stack([adapters[b] for _, b in names], dim=-1)  # [out, r, E]
                out[f"{stem}.lora_B.weight"] = b.reshape(b.shape[0], -1).contiguous()
    return out


def peft_to_canonical(
    peft: Mapping[str, torch.Tensor], cfg: ModelConfig, targets: tuple[str, ...], *, where: str
) -> dict[str, torch.Tensor]:
    """A PEFT ``adapter_model`` state dict -> our full adapter tensors (exact: the inverse of
    :func:`canonical_to_peft`). ``UserError`` naming ``where`` and the tensor on missing or
    unexpected tensors and on fused expert adapters whose rows are not experts x rank."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    experts = int(cfg.num_experts or 0)
    for i in range(cfg.num_layers):
        for target in targets:
            for ours, hf in _plain_pairs(cfg, i, target):
                out.update(pair_from_peft(peft, ours, hf, target, cfg, where=where, used=used))
            if target in EXPERT_PARAMETERS and cfg.is_moe_layer(i):
                stem = _expert_keys(i, target, targets)
                keys = (f"{stem}.lora_A.weight", f"{stem}.lora_B.weight")
                for key in keys:
                    if key not in peft:
                        raise UserError(f"{where}: missing tensor {key}")
                used.update(keys)
                a, b = peft[keys[0]], peft[keys[1]]
                if a.ndim != 2 or b.ndim != 2 or a.shape[0] % experts or b.shape[1] != a.shape[0]:
                    raise UserError(
                        f"{where}: {keys[0]} {tuple(a.shape)} and {keys[1]} {tuple(b.shape)} are not "
                        f"[{experts} experts x rank, in] and [out, rank x {experts} experts]"
                    )
                rank = a.shape[0] // experts
                b_e = b.reshape(b.shape[0], rank, experts)
                for e, name in enumerate(_routed(cfg, i, target)):
                    a_name, b_name = adapter_names(name)
                    out[a_name] = a[e * rank : (e + 1) * rank].contiguous().clone()
                    out[b_name] = b_e[..., e].contiguous().clone()
    check_all_read(peft, used, targets, where=where)
    return out
