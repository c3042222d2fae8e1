"""What one forward call needs besides the activations: one frozen context, built by the caller.

Every caller of the GPT/BERT forward (training, zero-shot scoring with last-layer query pruning,
the lm-evaluation-harness backend, KV-cache generation, checkpoint verification) describes its
call with a :class:`ForwardContext`; the transformer block derives each layer's
:class:`LayerContext` from it (RoPE tables, that layer's cache, whether the layer is pruned).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.models.kv_cache import KVCache, LayerKVCache

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin [b|1, s, rotary_dim]


@dataclass(frozen=True, kw_only=True)
class ForwardContext:
    """The per-call inputs of a model stage's forward.

    * ``attn_mask``: bool ``[b, 1, 1|s, s_k]`` (True = may attend), or None for the model's own
      rule (causal for GPT, full for BERT). With a KV cache, ``s_k`` counts cached positions too.
    * ``position_ids``: ``[b|1, s]``, default ``0 .. s-1``; with a cache they continue after the
      cached positions (learned position embeddings and RoPE both read them).
    * ``kv_cache``: incremental decoding; every layer appends its new keys/values to its entry.
    * ``query_index``: ``[b, n]`` (evaluation, last stage): output only at these positions
      (``[b, n, h]``); the last layer computes queries, attention, projection and MLP only there.
    """

    attn_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    kv_cache: KVCache | None = None
    query_index: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class LayerContext:
    """One layer's share of a :class:`ForwardContext` (made by the transformer block).

    ``rotary``: RoPE cos/sin ``[b|1, s, rot]`` at the fed positions, or None (learned positions);
    ``kv_cache``: this layer's cache entry; ``query_index [b, n]``: only on the pruned (last) layer.
    """

    attn_mask: torch.Tensor | None = None
    rotary: Rotary | None = None
    kv_cache: LayerKVCache | None = None
    query_index: torch.Tensor | None = None


def gather_positions(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [b|1, s, c]`` at ``index [b, n]`` -> ``[b, n, c]``."""
    x = x.expand(index.shape[0], -1, -1)
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))


def query_rows_mask(
    index: torch.Tensor, s: int, attn_mask: torch.Tensor | None, *, causal: bool
) -> torch.Tensor | None:
    """Bool ``[b, 1, n, s]`` for the queries at ``index [b, n]`` over ``s`` keys (True = may attend):
    causal from each query's own position (when ``causal``), and ``attn_mask [b, 1, 1|s, s]`` at
    the selected query rows."""
    mask = None
    if causal:
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
