"""The Megatron transformer layer with tensor-parallel attention and MLP (paper figure 3).

Activations are ``[b, s, h]`` (batch first, so PyTorch's scaled-dot-product attention applies
directly). Per layer, forward: two all-reduces over the TP group (after attention and after the
MLP, g); backward: two all-reduces (f before QKV and before the first MLP GEMM).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config import ModelConfig
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from pretrain.tensor_parallel.random import checkpointed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layer_norm(cfg: ModelConfig, ps: ParallelState) -> nn.LayerNorm:
    """A LayerNorm replicated on all TP ranks (its gradients are identical on every TP rank)."""
    return nn.LayerNorm(
        cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ps.device, dtype=DTYPES[cfg.params_dtype]
    )


class ParallelMLP(nn.Module):
    """``h -> ffn/t`` column-parallel, GeLU (local), ``ffn/t -> h`` row-parallel (one all-reduce)."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        dtype = DTYPES[cfg.params_dtype]
        self.dense_h_to_4h = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_size, ps=ps, dtype=dtype)
        self.dense_4h_to_h = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, ps=ps, dtype=dtype)
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate=self.approximate))


class ParallelAttention(nn.Module):
    """Self-attention with heads split across TP ranks.

    ``query_key_value``: column-parallel ``[3h/t, h]``, rows ordered ``[heads][3][head_dim]``
    (checkpoint_version 3.0), so a contiguous row split gives each rank whole heads.
    ``dense``: row-parallel ``[h, h/t]``. Attention dropout runs under the TP-region generator.
    """

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        dtype = DTYPES[cfg.params_dtype]
        self.heads = cfg.num_attention_heads // ps.tp_size
        self.head_dim = cfg.head_dim
        self.causal = not cfg.bidirectional
        self.dropout = cfg.attention_dropout
        self.rng = ps.rng
        self.query_key_value = ColumnParallelLinear(cfg.hidden_size, 3 * cfg.hidden_size, ps=ps, dtype=dtype)
        self.dense = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, ps=ps, dtype=dtype)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: ``[b, s, h]``; ``attn_mask``: bool ``[b, 1, 1|s, s]`` (True = may attend) or None."""
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, self.heads, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))  # each [b, heads, s, head_dim]
        p = self.dropout if self.training else 0.0
        causal = self.causal and attn_mask is None
        if p > 0.0:
            with self.rng.fork():
                ctx = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_mask, dropout_p=p, is_causal=causal
                )
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)
        return self.dense(ctx.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class TransformerLayer(nn.Module):
    """One layer. Pre-LN (default): ``x + drop(attn(ln(x)))`` then ``x + drop(mlp(ln(x)))``.

    Post-LN (original BERT): ``ln(x + drop(attn(x)))`` then ``ln(x + drop(mlp(x)))``, with the
    LayerNorms named ``post_attention_layernorm`` and ``post_mlp_layernorm``.
    """

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        self.post_ln = cfg.post_layernorm
        if not self.post_ln:
            self.input_layernorm = layer_norm(cfg, ps)
        self.self_attention = ParallelAttention(cfg, ps)
        self.post_attention_layernorm = layer_norm(cfg, ps)
        self.mlp = ParallelMLP(cfg, ps)
        if self.post_ln:
            self.post_mlp_layernorm = layer_norm(cfg, ps)
        self.hidden_dropout = cfg.hidden_dropout

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # Outside TP regions: the default generator, identical on all TP ranks.
        return F.dropout(x, self.hidden_dropout, self.training) if self.hidden_dropout > 0 else x

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.post_ln:
            x = self.post_attention_layernorm(x + self._drop(self.self_attention(x, attn_mask)))
            return self.post_mlp_layernorm(x + self._drop(self.mlp(x)))
        x = x + self._drop(self.self_attention(self.input_layernorm(x), attn_mask))
        return x + self._drop(self.mlp(self.post_attention_layernorm(x)))


class TransformerBlock(nn.Module):
    """The layers of one pipeline stage (or virtual chunk) and, on the last, the final LayerNorm.

    ``layer_numbers`` are the global indices of the layers held here; module names use local
    indices ``layers.0 .. layers.n-1`` as Megatron's checkpoints do.
    """

    def __init__(
        self, cfg: ModelConfig, ps: ParallelState, *, layer_numbers: Sequence[int], final_layernorm: bool
    ) -> None:
        super().__init__()
        self.layer_numbers = tuple(layer_numbers)
        self.layers = nn.ModuleList(TransformerLayer(cfg, ps) for _ in self.layer_numbers)
        if final_layernorm and not cfg.post_layernorm:
            self.final_layernorm = layer_norm(cfg, ps)
        self.recompute = cfg.recompute_activations
        self.rng = ps.rng

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            if self.recompute and self.training and torch.is_grad_enabled():
                x = checkpointed(layer, self.rng, x, attn_mask)
            else:
                x = layer(x, attn_mask)
        if hasattr(self, "final_layernorm"):
            x = self.final_layernorm(x)
        return x
