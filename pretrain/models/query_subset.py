"""A transformer layer computed only at selected query positions (evaluation of scored tokens).

When only some positions' outputs are needed (the scored tokens of a zero-shot evaluation window),
the *last* layer still needs keys and values at every position (its queries attend to them), but
its queries, attention, output projection, MLP and the final LayerNorm are needed only at the
selected positions. :func:`layer_at_positions` computes exactly that and returns ``[b, n, h]`` for
``query_index [b, n]``; it equals the full layer's output gathered at ``query_index``.

Works for every layer the configuration builds (pre-/post-LN, LayerNorm/RMSNorm, GeLU/SwiGLU,
learned positions/RoPE, multi-head/grouped-query attention, QK-norm, biases or none), under any
TP degree: the fused QKV weight ``[groups][q heads of the group, k, v][d]`` is split into its query
rows and key/value rows. Collectives: those of the full layer (f on the inputs, g after the
attention projection and the MLP) over the TP group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pretrain.models.rotary import apply_rotary
from pretrain.tensor_parallel.mappings import copy_to_tp_region

if TYPE_CHECKING:
    from pretrain.models.transformer import ParallelAttention, Rotary, TransformerLayer


def gather_positions(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [b|1, s, c]`` at ``index [b, n]`` -> ``[b, n, c]``."""
    x = x.expand(index.shape[0], -1, -1)
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))


def _split_qkv_weight(
    attn: ParallelAttention,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The fused QKV weight/bias split into query rows ``[heads d, h]`` and key/value rows
    ``[groups 2 d, h]`` (bias: ``[heads d]``, ``[groups 2 d]`` or None)."""
    lin = attn.query_key_value
    g, qpg, d = attn.groups, attn.q_per_group, attn.head_dim
    w = lin.weight.view(g, qpg + 2, d, -1)
    q_w, kv_w = w[:, :qpg].reshape(g * qpg * d, -1), w[:, qpg:].reshape(g * 2 * d, -1)
    if lin.bias is None:
        return q_w, kv_w, None, None
    b = lin.bias.view(g, qpg + 2, d)
    return q_w, kv_w, b[:, :qpg].reshape(-1), b[:, qpg:].reshape(-1)


def _query_mask(
    attn: ParallelAttention, index: torch.Tensor, s: int, attn_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """Bool ``[b, 1, n, s]`` (True = may attend): causal from each query's own position, and the
    caller's ``attn_mask [b, 1, 1|s, s]`` at the selected query rows."""
    mask = None
    if attn.causal:
        keys = torch.arange(s, device=index.device)
        mask = (keys[None, None, :] <= index[..., None])[:, None]
    if attn_mask is not None:
        rows = (
            attn_mask
            if attn_mask.shape[-2] == 1
            else attn_mask.expand(index.shape[0], -1, -1, -1).gather(
                2, index[:, None, :, None].expand(-1, attn_mask.shape[1], -1, s)
            )
        )
        mask = rows if mask is None else mask & rows
    return mask


def attention_at_positions(
    attn: ParallelAttention,
    x: torch.Tensor,
    index: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    rotary: Rotary | None = None,
) -> torch.Tensor:
    """Self-attention output ``[b, n, h]`` of the queries at ``index [b, n]``; keys and values from
    every position of ``x [b, s, h]``. Equals ``attn(x, attn_mask, rotary)`` gathered at ``index``."""
    b, s, _ = x.shape
    n = index.shape[1]
    q_w, kv_w, q_b, kv_b = _split_qkv_weight(attn)
    group = attn.query_key_value.group
    x_q = gather_positions(x, index)
    q = F.linear(copy_to_tp_region(x_q, group), q_w, q_b).view(b, n, attn.heads, attn.head_dim)
    kv = F.linear(copy_to_tp_region(x, group), kv_w, kv_b).view(b, s, attn.groups, 2, attn.head_dim)
    k, v = kv[:, :, :, 0], kv[:, :, :, 1]
    if hasattr(attn, "q_layernorm"):
        q, k = attn.q_layernorm(q), attn.k_layernorm(k)
    if rotary is not None:
        cos, sin = rotary
        q = apply_rotary(q, gather_positions(cos, index), gather_positions(sin, index))
        k = apply_rotary(k, cos, sin)
    p = attn.dropout if attn.training else 0.0
    mask = _query_mask(attn, index, s, attn_mask)
    gqa = attn.groups != attn.heads
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if p > 0.0:
        with attn.rng.fork():
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, enable_gqa=gqa)
    else:
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return attn.dense(ctx.transpose(1, 2).reshape(b, n, attn.heads * attn.head_dim))  # type: ignore[no-any-return]


def layer_at_positions(
    layer: TransformerLayer,
    x: torch.Tensor,
    index: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    rotary: Rotary | None = None,
) -> torch.Tensor:
    """``layer(x, attn_mask, rotary)`` ``[b, s, h]`` gathered at ``index [b, n]``, computing the
    queries, attention, projection and MLP only there: ``[b, n, h]``."""
    attn = layer.self_attention
    if layer.post_ln:
        out = attention_at_positions(attn, x, index, attn_mask, rotary)
        x_q = layer.post_attention_layernorm(gather_positions(x, index) + layer._drop(out))
        return layer.post_mlp_layernorm(x_q + layer._drop(layer.mlp(x_q)))  # type: ignore[no-any-return]
    out = attention_at_positions(attn, layer.input_layernorm(x), index, attn_mask, rotary)
    x_q = gather_positions(x, index) + layer._drop(out)
    return x_q + layer._drop(layer.mlp(layer.post_attention_layernorm(x_q)))  # type: ignore[no-any-return]
