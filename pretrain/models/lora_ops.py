"""The pieces every LoRA linear shares (:mod:`pretrain.models.lora` for the dense and attention
linears, :mod:`pretrain.models.lora_experts` for the expert MLPs): adapter names, the initial
``A``, the adapter matrix holder, input dropout, the fused low-rank update and the block-diagonal
spread of a fused target's ``B``."""

from __future__ import annotations

import contextlib
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.parallel.rng import RNGStatesTracker
from pretrain.tensor_parallel.layers import mark_partition

LORA_A, LORA_B = "lora_A", "lora_B"


def adapter_names(base_weight: str) -> tuple[str, str]:
    """``X.weight`` -> (``X.lora_A.weight``, ``X.lora_B.weight``)."""
    stem = base_weight.removesuffix(".weight")
    return f"{stem}.{LORA_A}.weight", f"{stem}.{LORA_B}.weight"


def init_adapter_a(name: str, shape: tuple[int, int], *, seed: int) -> torch.Tensor:
    """The full initial ``A`` ``[n r, in]`` of adapter tensor ``name``: PEFT's kaiming-uniform
    (uniform in ``+-1/sqrt(in)``) from a generator seeded by (seed, canonical name)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


class LoraWeight(nn.Module):
    """Holds one adapter matrix as ``.weight`` (so names read ``...lora_A.weight`` as in PEFT)."""

    def __init__(self, weight: torch.Tensor, dim: int | None) -> None:
        super().__init__()
        self.weight = mark_partition(nn.Parameter(weight), dim)


def dropped(x: torch.Tensor, p: float, training: bool, rng: RNGStatesTracker | None) -> torch.Tensor:
    """``x`` with dropout ``p`` while training (under ``rng``'s TP-region generator when given)."""
    if p == 0.0 or not training:
        return x
    with rng.fork() if rng is not None else contextlib.nullcontext():
        return F.dropout(x, p, True)


def add_low_rank(y: torch.Tensor, z: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``y + scaling * z B^T`` for ``y [..., out]``, ``z [..., k]`` (fp32), ``B [out, k]``.

    With a float32 ``y`` one ``addmm`` with the scaling folded into the small ``B`` (no pass over
    the activations for the scaling or the sum). With a lower-precision ``y`` (a bf16 base) PEFT's
    rounding: ``y`` upcast, the update added in fp32, the sum rounded once to ``y``'s dtype."""
    if y.dtype != z.dtype:
        return (y + F.linear(z, b) * scaling).to(y.dtype)
    out = torch.addmm(y.reshape(-1, y.shape[-1]), z.reshape(-1, z.shape[-1]), (b * scaling).t())
    return out.view(y.shape)


def block_diagonal_b(b: torch.Tensor, slice_mask: torch.Tensor) -> torch.Tensor:
    """``B [out, r]`` spread to ``[out, n r]`` so each row reads only its slice's block of the
    low-rank activation (``slice_mask [out, n]``: 1 where a row belongs to slice j); ``B`` itself
    when there is one slice."""
    if slice_mask.shape[1] == 1:
        return b
    return (b.unsqueeze(1) * slice_mask.unsqueeze(-1)).flatten(1)


def slice_mask(rows: list[torch.Tensor], n_rows: int, device: torch.device) -> torch.Tensor:
    """``[n_rows, len(rows)]``: 1 where a local row is in slice j (``rows[j]``: its row indices)."""
    mask = torch.zeros(n_rows, len(rows))
    for j, r in enumerate(rows):
        mask[r, j] = 1.0
    return mask.to(device)
