"""Rotary position embeddings (RoPE) as Megatron and Hugging Face's Llama apply them.

Non-interleaved halves: channel ``i`` of the rotated part pairs with ``i + rot/2``
(``rotate_half``); only the first ``rotary_dim = kv_channels * rotary_percent`` channels of each
head rotate, the rest pass through. Inverse frequencies ``base^(-2i/rot)`` are computed in float32
exactly as ``transformers`` does, optionally rescaled:

* Llama-3.1 scaling (``use_rope_scaling``): wavelengths above
  ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those below
  ``... / high_freq_factor`` kept, and the band between interpolated smoothly;
* linear scaling (``rotary_seq_len_interpolation_factor``): positions divided by the factor
  (HF ``rope_type="linear"``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from pretrain.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """``[rotary_dim / 2]`` float32 inverse frequencies of ``cfg`` (scaling applied)."""
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if cfg.use_rope_scaling:
        inv = llama3_scaled(
            inv,
            factor=cfg.rope_scaling_factor,
            low=cfg.rope_low_freq_factor,
            high=cfg.rope_high_freq_factor,
            old_context=cfg.rope_original_max_position_embeddings,
        )
    if cfg.rotary_seq_len_interpolation_factor is not None:
        inv = inv / cfg.rotary_seq_len_interpolation_factor
    return inv


def llama3_scaled(
    inv: torch.Tensor, *, factor: float, low: float, high: float, old_context: int
) -> torch.Tensor:
    """Llama-3.1's frequency-dependent RoPE scaling (``rope_type="llama3"``)."""
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Cos/sin tables ``[b|1, s, rotary_dim]`` for positions ``[b|1, s]`` (no parameters)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inv_freq = inverse_frequencies(cfg)  # a plain attribute: never in state dicts or casts

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq.to(device=position_ids.device, dtype=torch.float)
        freqs = position_ids[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, s, heads, d]`` by ``cos``/``sin [b|1, s, rot]`` (first ``rot`` channels)."""
    rot = cos.shape[-1]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def _rotate_into(
    out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, transpose: bool
) -> None:
    """``out = x cos + rotate_half(x) sin`` (:func:`apply_rotary` over the whole head, the same
    products and sums) without temporaries; ``transpose``: the transposed rotation, i.e. the
    input gradient of the rotation for the output gradient ``x`` (as autograd sums it)."""
    h = x.shape[-1] // 2
    torch.mul(x, cos, out=out)
    if transpose:  # dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1
        out[..., :h].addcmul_(x[..., h:], sin[..., h:])
        out[..., h:].addcmul_(x[..., :h], sin[..., :h], value=-1.0)
    else:  # y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
        out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-1.0)
        out[..., h:].addcmul_(x[..., :h], sin[..., h:])


class _SplitRotateQKV(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        b, s, g, slots, d = qkv.shape
        heads_first = qkv.permute(0, 2, 3, 1, 4)  # [b, g, q + 2, s, d], a view
        cos, sin = cos.view(cos.shape[0], 1, 1, s, d), sin.view(sin.shape[0], 1, 1, s, d)
        q, k = qkv.new_empty(b, g, slots - 2, s, d), qkv.new_empty(b, g, 1, s, d)
        _rotate_into(q, heads_first[:, :, :-2], cos, sin, transpose=False)
        _rotate_into(k, heads_first[:, :, -2:-1], cos, sin, transpose=False)
        v = heads_first[:, :, -1].clone(memory_format=torch.contiguous_format)
        ctx.save_for_backward(cos, sin)
        ctx.shape = qkv.shape
        return q.view(b, g * (slots - 2), s, d), k.view(b, g, s, d), v

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        b, s, g, _, d = ctx.shape
        grad = cos.new_empty(ctx.shape)
        heads_first = grad.permute(0, 2, 3, 1, 4)
        for part, rows in zip(grads, (slice(0, -2), slice(-2, -1), slice(-1, None)), strict=True):
            dst = heads_first[:, :, rows]
            if part is None:
                dst.zero_()
            elif rows.stop is None:  # v: not rotated
                dst.copy_(part.view(b, g, 1, s, d))
            else:
                _rotate_into(dst, part.view(b, g, -1, s, d), cos, sin, transpose=True)
        return grad, None, None


def split_rotate_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The fused QKV output ``[b, s, g, q + 2, d]`` (per group: q heads, k, v) split into q
    ``[b, g q, s, d]`` and k ``[b, g, s, d]`` rotated by ``cos``/``sin [b|1, s, d]`` (RoPE over the
    whole head) and v ``[b, g, s, d]``: new contiguous heads-first tensors (the layout the CPU
    attention kernel reads fastest), the values of the slicing and :func:`apply_rotary`. Backward
    writes each part's gradient once into one ``[b, s, g, q + 2, d]`` tensor (autograd zero-fills
    a full-size tensor per part and sums them)."""
    return _SplitRotateQKV.apply(qkv, cos, sin)  # type: ignore[no-any-return]
