"""Tiny GPT configs, seeded batches and single-process references shared by parallel tests."""

from __future__ import annotations

import torch

from pretrain.config import ModelConfig
from pretrain.models.gpt import GPTModel
from pretrain.models.init import init_model_parameters
from pretrain.models.sharding import gather_full_state_dict
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.cross_entropy import masked_mean


def tiny_config(**overrides: object) -> ModelConfig:
    """1003 tokens: padding needed at every tp (1024 for tp <= 8 with divisible_by 128)."""
    kw: dict[str, object] = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=8,
        vocab_size=1003,
        max_position_embeddings=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        make_vocab_size_divisible_by=128,
    )
    kw.update(overrides)
    return ModelConfig(**kw)  # type: ignore[arg-type]


def full_weights(cfg: ModelConfig, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Canonical full weights: seeded init plus noise so biases and LayerNorms are non-trivial."""
    model = GPTModel(cfg, ParallelState.single())
    init_model_parameters(model, seed=seed)
    full = gather_full_state_dict(model)
    gen = torch.Generator().manual_seed(seed + 1)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in full.items()}


def batch(cfg: ModelConfig, *, b: int = 4, s: int = 16, seed: int = 7) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=gen)
    mask = (torch.rand(b, s, generator=gen) > 0.2).float()
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}


def single_process_reference(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], data: dict[str, torch.Tensor]
):
    """Logits ``[b, s, V]``, masked-mean loss and full gradients of one process."""
    from pretrain.models.sharding import load_full_state_dict

    model = GPTModel(cfg, ParallelState.single())
    load_full_state_dict(model, weights)
    logits = model.full_logits(model(data["tokens"]))
    losses = model(data["tokens"], labels=data["labels"])
    loss = masked_mean(losses, data["loss_mask"])
    loss.backward()
    return logits.detach(), loss.detach(), gather_full_state_dict(model, grads=True)
