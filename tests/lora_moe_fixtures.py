"""Tiny HF mixture-of-experts models with PEFT LoRA (``target_parameters`` on the fused experts) and
our GPT model with the same adapters (tests)."""

from __future__ import annotations

from typing import Any

import torch

from pretrain.config import ModelConfig
from pretrain.models.families.moe_lora import canonical_to_peft, peft_targets
from pretrain.models.gpt import GPTModel
from pretrain.models.lora import LoraConfig, add_lora, is_lora_name
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.parallel.state import ParallelState
from tests.moe_hf_fixtures import hf_model, import_state

LORA = LoraConfig(rank=2, alpha=4.0)


def ours_from_hf(family: str, hf: Any, cfg: LoraConfig = LORA, *, seed: int = 1,
                 ps: ParallelState | None = None) -> tuple[GPTModel, dict[str, torch.Tensor]]:  # fmt: skip
    """Our model holding ``hf``'s weights with adapters added, and the canonical base weights."""
    mcfg, full = import_state(family, hf)
    model = GPTModel(mcfg, ps or ParallelState.single())
    load_full_state_dict(model, full)
    add_lora(model, cfg, seed=seed)
    return model, full


def random_adapters(model: GPTModel, seed: int = 5) -> dict[str, torch.Tensor]:
    """Layout-independent random full adapters for ``model``'s adapter names (B no longer zero)."""
    gen = torch.Generator().manual_seed(seed)
    full = {k: v for k, v in gather_full_state_dict(model).items() if is_lora_name(k)}
    return {k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in sorted(full.items())}


def peft_model(hf: Any, mcfg: ModelConfig, adapters: dict[str, torch.Tensor] | None,
               cfg: LoraConfig = LORA) -> Any:  # fmt: skip
    """``hf`` wrapped by PEFT (``target_modules`` and ``target_parameters``), loaded with our
    full canonical ``adapters`` when given."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, set_peft_model_state_dict

    modules, params = peft_targets(mcfg, cfg.targets)
    pcfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=modules, target_parameters=params)
    pm = get_peft_model(hf, pcfg)
    if adapters is not None:
        res = set_peft_model_state_dict(pm, canonical_to_peft(adapters, mcfg, cfg.targets))
        assert not res.unexpected_keys, res.unexpected_keys
    return pm


def tiny(family: str, seed: int = 0) -> Any:
    return hf_model(family, seed)
