"""A tiny HF Llama-family model with PEFT LoRA and our GPT model with the same adapter (tests)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pretrain.config import CpuGemm
from pretrain.models.families import llama as hf_llama
from pretrain.models.families.llama_lora import canonical_to_peft, peft_target_modules
from pretrain.models.gpt import GPTModel
from pretrain.models.lora import LoraConfig, add_lora, is_lora_name
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.parallel.state import ParallelState
from tests.llama_fixtures import hf_model

LORA = LoraConfig(rank=4, alpha=8.0)


def ours_from_hf(
    hf: Any,
    cfg: LoraConfig = LORA,
    *,
    seed: int = 1,
    ps: ParallelState | None = None,
    fused_kernels: bool = False,
    params_dtype: str | None = None,
    cpu_gemm: CpuGemm = "auto",
) -> GPTModel:
    """Our model holding ``hf``'s weights (in ``params_dtype`` when given), with fp32 adapters added
    (A from ``seed``, B zero); ``cpu_gemm`` the frozen GEMMs' library (``--cpu-gemm``)."""
    mcfg = dataclasses.replace(hf_llama.model_config_from_hf(hf.config), fused_kernels=fused_kernels,
                               cpu_gemm=cpu_gemm)  # fmt: skip
    if params_dtype is not None:
        mcfg = dataclasses.replace(mcfg, params_dtype=params_dtype)
    model = GPTModel(mcfg, ps or ParallelState.single())
    load_full_state_dict(model, hf_llama.hf_to_canonical(hf.state_dict(), mcfg))
    add_lora(model, cfg, seed=seed)
    return model


def randomise_adapters(model: GPTModel, seed: int = 5) -> dict[str, torch.Tensor]:
    """Fill the adapters with layout-independent random values (B no longer zero); returns them full."""
    gen = torch.Generator().manual_seed(seed)
    full = {k: v for k, v in gather_full_state_dict(model).items() if is_lora_name(k)}
    full = {k: 0.3 * torch.randn(v.shape, generator=gen) for k, v in sorted(full.items())}
    load_full_state_dict(model, full, strict=False)
    return full


def peft_model(hf: Any, adapters: dict[str, torch.Tensor] | None, cfg: LoraConfig = LORA) -> Any:
    """``hf`` wrapped by PEFT with the same LoRA settings, loaded with ``adapters`` (our full
    canonical adapter tensors) when given."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, set_peft_model_state_dict

    pcfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
        target_modules=peft_target_modules(cfg.targets),
    )  # fmt: skip
    pm = get_peft_model(hf, pcfg)
    if adapters is not None:
        mcfg = hf_llama.model_config_from_hf(hf.config)
        res = set_peft_model_state_dict(pm, canonical_to_peft(adapters, mcfg, cfg.targets))
        assert not res.unexpected_keys, res.unexpected_keys
    return pm


def tiny_hf(case: str = "llama3", **kw: Any) -> Any:
    return hf_model(case, **kw)
