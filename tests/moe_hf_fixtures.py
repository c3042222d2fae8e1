"""Tiny random Hugging Face MoE models of the four families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)
with widely spread router weights (so each token's top-k differs), and helpers to build ours."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pretrain.config import ModelConfig
from pretrain.models.families import family_of_model_type
from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import load_full_state_dict
from pretrain.parallel.state import ParallelState

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_COMMON: dict[str, Any] = dict(
    vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, num_experts_per_tok=2, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, pad_token_id=None,
)  # fmt: skip
# Expert width 24 (2I = 48 != hidden 32, so the fused layout's orientation is unambiguous).
CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=6, intermediate_size=24),
    "qwen2_moe": dict(num_experts=6, moe_intermediate_size=24, intermediate_size=40,
                      shared_expert_intermediate_size=20, norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen3_moe": dict(num_experts=6, moe_intermediate_size=24, intermediate_size=40, head_dim=12,
                      norm_topk_prob=True, rope_parameters={"rope_theta": 5000.0, "rope_type": "default"}),
    "olmoe": dict(num_experts=6, intermediate_size=24, norm_topk_prob=False),
}  # fmt: skip


def hf_config(family: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**_COMMON, **CONFIGS[family], **overrides})


def hf_model(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A random float32 model; router rows scaled up so that routes differ between tokens."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))  # wide spread (std 1 over hidden 32)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    return model


def save_hf(family: str, directory: Path, seed: int = 0, **overrides: Any) -> Any:
    model = hf_model(family, seed, **overrides)
    model.save_pretrained(str(directory))
    return model


def our_model(cfg: ModelConfig, full: dict[str, torch.Tensor]) -> GPTModel:
    model = GPTModel(cfg, ParallelState.single()).eval()
    load_full_state_dict(model, full)
    return model


def import_state(family: str, hf: Any) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Our config and canonical tensors of an in-memory HF model (fused expert layout)."""
    fam = family_of_model_type(family)
    assert fam is not None
    state = {k: v for k, v in hf.state_dict().items()}
    imported = fam.module().import_hf(state, hf.config, fam)
    return imported.cfg, {n: make() for n, make in imported.makers.items()}


def probe(vocab: int, seed: int = 3, shape: tuple[int, int] = (2, 24)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
