"""Choosing the next token: greedy, or sampling with temperature, top-k and top-p (nucleus).

Every row has its own ``torch.Generator`` seeded with ``seed + row_seed_offset``, so a row's
samples do not depend on which other rows share its batch, nor on the batch size. Logits are
float32 ``[b, V]`` over the true vocabulary (padding rows already removed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.utils.errors import UserError


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How the next token is chosen. ``greedy`` ignores the other fields."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int = 1234

    def __post_init__(self) -> None:
        if not self.greedy and self.temperature <= 0:
            raise UserError(f"--temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")


def row_generators(cfg: SamplingConfig, seeds: list[int], device: torch.device) -> list[torch.Generator]:
    """One generator per row, seeded ``cfg.seed + seeds[i]`` (``seeds``: stable per-request ids)."""
    return [torch.Generator(device=device).manual_seed(cfg.seed + s) for s in seeds]


def filter_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Scaled logits ``[b, V]`` with everything outside top-k / top-p set to ``-inf``.

    Top-p keeps the smallest prefix of tokens (by descending probability) whose mass reaches
    ``top_p``; the most likely token always survives. Ties are ordered by token id.
    """
    x = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        order = torch.sort(x, dim=-1, descending=True, stable=True)
        probs = order.values.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        drop_sorted = before >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order.indices, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def next_tokens(
    logits: torch.Tensor, cfg: SamplingConfig, generators: list[torch.Generator] | None = None
) -> torch.Tensor:
    """Next token ids ``[b]`` from logits ``[b, V]``: argmax (first maximum) or one sample per row."""
    if cfg.greedy:
        return logits.argmax(dim=-1)
    assert generators is not None and len(generators) == logits.shape[0], "one generator per row"
    probs = filter_logits(logits, cfg).softmax(dim=-1)
    picks = [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)]
    return torch.cat(picks)
