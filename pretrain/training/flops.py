"""Model FLOPs per iteration (Megatron's GPT formula, Narayanan et al. 2021, eq. 3).

``F = 24 B s l h^2 (1 + s / (6 h) + V / (16 l h))`` per forward-and-backward without
recomputation, i.e. ``72 B s l h^2 (...)`` for 3 passes (forward + 2x backward); with full
activation recomputation a second forward adds one pass (factor 96).
"""

from __future__ import annotations

from pretrain.config import ModelConfig


def gpt_flops_per_iteration(
    cfg: ModelConfig, *, global_batch: int, seq_length: int, padded_vocab: int
) -> float:
    b, s, l_, h, v = global_batch, seq_length, cfg.num_layers, cfg.hidden_size, padded_vocab
    passes = 4 if cfg.recompute_activations else 3
    return 24.0 * passes * b * s * l_ * h * h * (1 + s / (6.0 * h) + v / (16.0 * l_ * h))
