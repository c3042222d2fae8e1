"""Canonical LoRA adapter tensors <-> a Hugging Face PEFT LoRA adapter of a Llama-family model.

A pure name/tensor mapping (no ``peft`` import). Our fused adapters hold one ``A`` block per slice
(:mod:`pretrain.models.lora`), so the mapping is exact both ways:

* ``query_key_value``: ``A [3r, h]`` = ``[A_q; A_k; A_v]``; ``B`` rows (Megatron's grouped order)
  split into ``q_proj``/``k_proj``/``v_proj`` rows in HF head order (:func:`llama.split_qkv`).
* SwiGLU ``dense_h_to_4h``: ``A [2r, h]`` = ``[A_gate; A_up]``, ``B`` = ``[B_gate; B_up]``.
* ``dense`` <-> ``o_proj``, ``dense_4h_to_h`` <-> ``down_proj``: the same tensors.

PEFT names: ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` (the adapter
name ``default`` is not stored in ``adapter_model.safetensors``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pretrain.config import ModelConfig
from pretrain.models.families.llama import LM, fuse_qkv, split_qkv
from pretrain.models.lora import ALL_TARGETS, TARGET_MODULES, adapter_names
from pretrain.utils.errors import UserError

PEFT_PREFIX = "base_model.model."
# our target -> the HF modules (under model.layers.{i}.) its adapter becomes
HF_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "proj": ("self_attn.o_proj",),
    "fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "fc2": ("mlp.down_proj",),
}


def peft_target_modules(targets: tuple[str, ...]) -> list[str]:
    """PEFT ``target_modules`` (``q_proj``...) of our ``targets``."""
    return [m.rsplit(".", 1)[1] for t in targets for m in HF_MODULES[t]]


def targets_of_peft_modules(modules: list[str], *, where: str) -> tuple[str, ...]:
    """Our targets from PEFT ``target_modules``; a target's HF modules must come all or none."""
    given = {m.rsplit(".", 1)[-1] for m in modules}
    out = []
    for target in ALL_TARGETS:
        names = {m.rsplit(".", 1)[1] for m in HF_MODULES[target]}
        if names <= given:
            out.append(target)
        elif names & given:
            raise UserError(
                f"{where}: target_modules has {sorted(names & given)} without {sorted(names - given)}; "
                f"our fused {target} adapter needs all of {sorted(names)}"
            )
    unknown = given - {m.rsplit(".", 1)[1] for ms in HF_MODULES.values() for m in ms}
    if unknown or not out:
        raise UserError(f"{where}: target_modules {sorted(given)} are not Llama-family linears we adapt")
    return tuple(out)


def _stems(i: int, target: str) -> tuple[str, list[str]]:
    ours = f"{LM}encoder.layers.{i}.{TARGET_MODULES[target]}.weight"
    return ours, [f"{PEFT_PREFIX}model.layers.{i}.{m}" for m in HF_MODULES[target]]


def _split_b(target: str, b: torch.Tensor, cfg: ModelConfig, parts: int) -> tuple[torch.Tensor, ...]:
    if target == "qkv":
        return split_qkv(b, groups=cfg.query_groups, head_dim=cfg.head_dim)
    return tuple(b.chunk(parts))


def pair_to_peft(
    adapters: Mapping[str, torch.Tensor], ours: str, hf: list[str], target: str, cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """The PEFT tensors of our adapter of base weight ``ours``, whose target is the HF modules
    ``hf`` (full PEFT module names): A split by slice, B by rows (contiguous copies)."""
    a_name, b_name = adapter_names(ours)
    if a_name not in adapters or b_name not in adapters:
        raise UserError(f"LoRA -> PEFT: missing adapter tensor {a_name}")
    a_parts = adapters[a_name].chunk(len(hf))
    b_parts = _split_b(target, adapters[b_name], cfg, len(hf))
    out: dict[str, torch.Tensor] = {}
    for stem, a, b in zip(hf, a_parts, b_parts, strict=True):
        out[f"{stem}.lora_A.weight"] = a.contiguous().clone()
        out[f"{stem}.lora_B.weight"] = b.contiguous().clone()
    return out


def canonical_to_peft(
    adapters: Mapping[str, torch.Tensor], cfg: ModelConfig, targets: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """Our full adapter tensors -> a PEFT ``adapter_model`` state dict (contiguous copies)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        for target in targets:
            out.update(pair_to_peft(adapters, *_stems(i, target), target, cfg))
    return out


def pair_from_peft(
    peft: Mapping[str, torch.Tensor], ours: str, hf: list[str], target: str, cfg: ModelConfig, *,
    where: str, used: set[str],
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Our adapter of base weight ``ours`` from the PEFT tensors of the HF modules ``hf`` (the
    inverse of :func:`pair_to_peft`); the keys read are added to ``used``."""
    a_s: list[torch.Tensor] = []
    b_s: list[torch.Tensor] = []
    for stem in hf:
        for kind, acc in (("lora_A", a_s), ("lora_B", b_s)):
            key = f"{stem}.{kind}.weight"
            if key not in peft:
                raise UserError(f"{where}: missing tensor {key}")
            acc.append(peft[key])
            used.add(key)
    if len({a.shape[0] for a in a_s} | {b.shape[1] for b in b_s}) != 1:
        raise UserError(f"{where}: the adapters of {', '.join(hf)} differ in rank")
    a_name, b_name = adapter_names(ours)
    if target == "qkv":
        b = fuse_qkv(*b_s, groups=cfg.query_groups, head_dim=cfg.head_dim)
    else:
        b = torch.cat(b_s).contiguous()
    return {a_name: torch.cat(a_s).contiguous(), b_name: b}


def check_all_read(
    peft: Mapping[str, torch.Tensor], used: set[str], targets: tuple[str, ...], *, where: str
) -> None:
    """``UserError`` naming the first PEFT tensor no target read."""
    extra = sorted(set(peft) - used)
    if extra:
        raise UserError(
            f"{where}: unexpected tensors {extra[:3]} (only LoRA A/B of {list(targets)} are read)"
        )


def peft_to_canonical(
    peft: Mapping[str, torch.Tensor], cfg: ModelConfig, targets: tuple[str, ...], *, where: str
) -> dict[str, torch.Tensor]:
    """A PEFT ``adapter_model`` state dict -> our full adapter tensors (exact: the inverse of
    :func:`canonical_to_peft`). ``UserError`` (naming ``where`` and the tensor) on missing or
    unexpected tensors and on ranks that differ between the fused modules."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for i in range(cfg.num_layers):
        for target in targets:
            out.update(pair_from_peft(peft, *_stems(i, target), target, cfg, where=where, used=used))
    check_all_read(peft, used, targets, where=where)
    return out
