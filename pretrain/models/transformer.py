"""The Megatron transformer layer with tensor-parallel attention and MLP (paper figure 3).

Activations are ``[b, s, h]`` (batch first, so PyTorch's scaled-dot-product attention applies
directly). Per layer, forward: two all-reduces over the TP group (after attention and after the
MLP, g); backward: two all-reduces (f before QKV and before the first MLP GEMM).

The same layer is a Llama-family layer by configuration (:class:`~pretrain.config.ModelConfig`):
RMSNorm, SwiGLU, RoPE, grouped-query attention, no-bias linears, QKV bias, QK-norm.

With ``cfg.sequence_parallel`` (and TP > 1) the residual stream between the GEMMs is this rank's
sequence shard ``[b, s/t, h]``: all-gather before QKV and fc1, reduce-scatter after the output
projection and fc2 (:mod:`pretrain.tensor_parallel.sequence_parallel`). Recomputation
(``recompute_granularity``) is planned by :mod:`pretrain.models.recompute`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pretrain.config import ModelConfig
from pretrain.models.forward_context import (
    ForwardContext,
    LayerContext,
    Rotary,
    gather_positions,
    query_rows_mask,
)
from pretrain.models.moe.layer import MoEMLP
from pretrain.models.norms import DTYPES, full_width_norm, layer_norm
from pretrain.models.recompute import layer_groups
from pretrain.models.rotary import RotaryEmbedding, apply_rotary, split_rotate_qkv
from pretrain.models.swiglu import swiglu
from pretrain.parallel.rng import checkpointed
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from pretrain.tensor_parallel.mappings import copy_to_tp_region
from pretrain.tensor_parallel.sequence_parallel import (
    gather_from_sequence_region,
    mark_sequence_parallel,
    scatter_to_sequence_region,
)

__all__ = ["DTYPES", "ParallelAttention", "ParallelMLP", "TransformerBlock", "TransformerLayer", "layer_norm"]


class ParallelMLP(nn.Module):
    """``h -> ffn/t`` column-parallel, activation (local), ``ffn/t -> h`` row-parallel (one all-reduce).

    GeLU, or SwiGLU (``cfg.swiglu``): ``dense_h_to_4h`` is ``[2 ffn/t, h]`` holding this rank's
    ``[gate slice; up slice]`` and the activation is ``silu(gate) * up`` (Megatron's layout).
    """

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        dtype = DTYPES[cfg.params_dtype]
        bias = cfg.add_bias_linear
        fc1_out = 2 * cfg.ffn_size if cfg.swiglu else cfg.ffn_size
        sp = cfg.sequence_parallel
        self.dense_h_to_4h = ColumnParallelLinear(
            cfg.hidden_size, fc1_out, ps=ps, bias=bias, dtype=dtype, sequence_parallel=sp
        )
        self.dense_4h_to_h = RowParallelLinear(
            cfg.ffn_size, cfg.hidden_size, ps=ps, bias=bias, dtype=dtype, sequence_parallel=sp
        )
        self.swiglu = cfg.swiglu
        self.fused = cfg.fused_kernels
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"
        self.squared_relu = cfg.squared_relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dense_h_to_4h(x)
        if self.swiglu:  # silu(gate) * up; a frozen fc1 (no weight gradient) spends memory on speed
            keep = not self.dense_h_to_4h.weight.requires_grad
            return self.dense_4h_to_h(swiglu(y, keep_silu=keep, fused=self.fused))
        if self.squared_relu:
            return self.dense_4h_to_h(F.relu(y).square())
        return self.dense_4h_to_h(F.gelu(y, approximate=self.approximate))


class ParallelAttention(nn.Module):
    """Self-attention with heads split across TP ranks (multi-head or grouped-query).

    ``query_key_value``: column-parallel, rows ``[groups][q heads of the group, k, v][head_dim]``
    (Megatron's layout; multi-head attention is one group per head, i.e. checkpoint_version 3.0's
    ``[heads][3][head_dim]``), so a contiguous row split gives each rank whole groups. With more
    TP ranks than groups each rank holds its query heads and a replica of its group's key/value
    head (see :mod:`pretrain.models.sharding`). ``dense``: row-parallel ``[h, nq d/t]``.
    Optional QK-norm (per head, before RoPE) and RoPE. Attention dropout runs under the
    TP-region generator.
    """

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        dtype = DTYPES[cfg.params_dtype]
        self.heads = cfg.num_attention_heads // ps.tp_size
        self.groups = max(cfg.query_groups // ps.tp_size, 1)  # key/value heads on this rank
        self.q_per_group = self.heads // self.groups
        self.head_dim = cfg.head_dim
        self.causal = not cfg.bidirectional
        self.dropout = cfg.attention_dropout
        self.rng = ps.rng
        self.selective_recompute = cfg.recompute_granularity == "selective"
        rows = (self.heads + 2 * self.groups) * self.head_dim
        sp = cfg.sequence_parallel
        self.query_key_value = ColumnParallelLinear(
            cfg.hidden_size, rows * ps.tp_size, ps=ps, bias=cfg.qkv_bias, dtype=dtype, local_output_size=rows,
            sequence_parallel=sp,
        )  # fmt: skip
        proj = cfg.num_attention_heads * cfg.head_dim
        self.dense = RowParallelLinear(
            proj, cfg.hidden_size, ps=ps, bias=cfg.add_bias_linear, dtype=dtype, sequence_parallel=sp
        )
        if cfg.qk_layernorm:
            self.q_layernorm = layer_norm(cfg, ps, cfg.head_dim, per_head=True)
            self.k_layernorm = layer_norm(cfg, ps, cfg.head_dim, per_head=True)
        if cfg.qk_layernorm_full_width:  # OLMoE: one RMSNorm over all query / all key channels
            self.q_full_layernorm = full_width_norm(cfg, ps, cfg.num_attention_heads * cfg.head_dim)
            self.k_full_layernorm = full_width_norm(cfg, ps, cfg.query_groups * cfg.head_dim)

    def _qkv(self, x: torch.Tensor, rotary: Rotary | None) -> tuple[torch.Tensor, ...]:
        """q ``[b, heads, s, d]``, k and v ``[b, groups, s, d]`` (QK-norm and RoPE applied)."""
        qkv = self.query_key_value(x)  # [b, s, rows]: the whole sequence under sequence parallelism
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.groups, self.q_per_group + 2, self.head_dim)
        if self._whole_head_rope_only(rotary):  # split and rotate in one node (one gradient tensor)
            return split_rotate_qkv(qkv, *rotary)  # type: ignore[misc]
        q = qkv[:, :, :, : self.q_per_group].reshape(b, s, self.heads, self.head_dim)
        k, v = qkv[:, :, :, self.q_per_group], qkv[:, :, :, self.q_per_group + 1]
        return self._norm_and_rotate(q, k, v, rotary, rotary)

    def _whole_head_rope_only(self, rotary: Rotary | None) -> bool:
        """RoPE over the whole head and no QK-norm: what :func:`split_rotate_qkv` computes."""
        norms = hasattr(self, "q_layernorm") or hasattr(self, "q_full_layernorm")
        return rotary is not None and not norms and rotary[0].shape[-1] == self.head_dim

    def _qkv_at(
        self, x: torch.Tensor, index: torch.Tensor, rotary: Rotary | None
    ) -> tuple[torch.Tensor, ...]:
        """As :meth:`_qkv` with queries only at ``index [b, n]``: q ``[b, heads, n, d]``; keys and
        values at every position. The fused weight ``[groups][q heads, k, v][d]`` is split into
        its query rows and key/value rows, so no query row is computed for other positions."""
        b, s, _ = x.shape
        n = index.shape[1]
        lin, g, qpg, d = self.query_key_value, self.groups, self.q_per_group, self.head_dim
        if hasattr(lin, "lora_A"):  # a LoRA adapter: its q rows are not a slice of the weight
            q, k, v = self._qkv(x, rotary)
            rows = gather_positions(q.transpose(1, 2).reshape(b, s, -1), index)
            return rows.view(b, n, self.heads, d).transpose(1, 2), k, v
        w = lin.weight.view(g, qpg + 2, d, -1)
        q_w, kv_w = w[:, :qpg].reshape(g * qpg * d, -1), w[:, qpg:].reshape(g * 2 * d, -1)
        q_b = kv_b = None
        if lin.bias is not None:
            bias = lin.bias.view(g, qpg + 2, d)
            q_b, kv_b = bias[:, :qpg].reshape(-1), bias[:, qpg:].reshape(-1)
        x_q = gather_positions(x, index)
        q = F.linear(copy_to_tp_region(x_q, lin.group), q_w, q_b).view(b, n, self.heads, d)
        kv = F.linear(copy_to_tp_region(x, lin.group), kv_w, kv_b).view(b, s, g, 2, d)
        q_rotary = (
            None
            if rotary is None
            else (gather_positions(rotary[0], index), gather_positions(rotary[1], index))
        )
        return self._norm_and_rotate(q, kv[:, :, :, 0], kv[:, :, :, 1], q_rotary, rotary)

    def _norm_and_rotate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_rotary: Rotary | None,
                         k_rotary: Rotary | None) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """QK-norm (per head, or full-width) then RoPE on ``[b, s, heads, d]`` tensors; returned heads-first."""
        if hasattr(self, "q_layernorm"):
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if hasattr(self, "q_full_layernorm"):  # over [heads d] / [groups d] of this rank, TP-summed
            q = self.q_full_layernorm(q.flatten(-2)).view_as(q)
            k = self.k_full_layernorm(k.flatten(-2)).view_as(k)
        if q_rotary is not None and k_rotary is not None:
            q, k = apply_rotary(q, *q_rotary), apply_rotary(k, *k_rotary)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _core_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v with attention dropout: ``[b, heads, s_q, d]``. The part that
        selective recomputation redoes in backward (its probabilities are ``[b, heads, s, s]``)."""
        p = self.dropout if self.training else 0.0
        gqa = self.groups != self.heads
        with self.rng.fork() if p > 0.0 else contextlib.nullcontext():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, enable_gqa=gqa
            )

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """``x [b, s, h]`` -> ``[b, s, h]``, or ``[b, n, h]`` at ``ctx.query_index [b, n]``.

        ``ctx.attn_mask`` bool ``[b, 1, 1|s, s_k]`` (None: causal, or full when bidirectional);
        ``ctx.kv_cache`` (incremental decoding): this rank's keys/values of earlier positions, the
        new ones appended, attention over all of them. Collectives: f before QKV (backward) and
        g after the output projection, over the TP group.
        """
        b, s, _ = x.shape
        index = ctx.query_index
        q, k, v = self._qkv(x, ctx.rotary) if index is None else self._qkv_at(x, index, ctx.rotary)
        if ctx.kv_cache is not None:
            k, v = ctx.kv_cache.update(k, v)
        mask, causal = ctx.attn_mask, self.causal and ctx.attn_mask is None
        if index is not None:
            mask, causal = query_rows_mask(index, s, ctx.attn_mask, causal=self.causal), False
        if self.selective_recompute and self.training and torch.is_grad_enabled():
            ctx_out = checkpointed(self._core_attention, self.rng, q, k, v, mask, causal)
        else:
            ctx_out = self._core_attention(q, k, v, mask, causal)
        rows = ctx_out.shape[2]
        return self.dense(ctx_out.transpose(1, 2).reshape(b, rows, self.heads * self.head_dim))  # type: ignore[no-any-return]


class TransformerLayer(nn.Module):
    """One layer. Pre-LN (default): ``x + drop(attn(ln(x)))`` then ``x + drop(mlp(ln(x)))``.

    Post-LN (original BERT): ``ln(x + drop(attn(x)))`` then ``ln(x + drop(mlp(x)))``, with the
    LayerNorms named ``post_attention_layernorm`` and ``post_mlp_layernorm``. The MLP is a
    mixture of experts where ``cfg.is_moe_layer(layer_number)`` (global index).
    """

    def __init__(self, cfg: ModelConfig, ps: ParallelState, *, layer_number: int = 0) -> None:
        super().__init__()
        self.post_ln = cfg.post_layernorm
        if not self.post_ln:
            self.input_layernorm = layer_norm(cfg, ps)
        self.self_attention = ParallelAttention(cfg, ps)
        self.post_attention_layernorm = layer_norm(cfg, ps)
        moe = cfg.is_moe_layer(layer_number)
        self.mlp = MoEMLP(cfg, ps, layer_number=layer_number) if moe else ParallelMLP(cfg, ps)
        if self.post_ln:
            self.post_mlp_layernorm = layer_norm(cfg, ps)
        self.hidden_dropout = cfg.hidden_dropout
        self.sequence_parallel = cfg.sequence_parallel and ps.tp_size > 1
        self.rng, self.tp_group = ps.rng, ps.tp_group
        # The MoE MLP routes whole replicated token sets: under SP it gets the gathered sequence.
        self.moe_on_shards = moe and self.sequence_parallel
        if self.sequence_parallel:
            for name in ("input_layernorm", "post_attention_layernorm", "post_mlp_layernorm"):
                if hasattr(self, name):
                    mark_sequence_parallel(getattr(self, name))

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # Outside TP regions: the default generator, identical on all TP ranks; on sequence shards
        # the TP-region generator (as Megatron), so ranks draw independent masks for their positions.
        if self.hidden_dropout <= 0 or not self.training:
            return x
        with self.rng.fork() if self.sequence_parallel else contextlib.nullcontext():
            return F.dropout(x, self.hidden_dropout, True)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if not self.moe_on_shards:
            return self.mlp(x)  # type: ignore[no-any-return]
        # The MoE's own f/g make its input gradient complete on every rank: backward keeps the shard.
        out = self.mlp(gather_from_sequence_region(x, self.tp_group))
        return scatter_to_sequence_region(out, self.tp_group)

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """``x [b, s, h]`` -> ``[b, s, h]``, or ``[b, n, h]`` at ``ctx.query_index [b, n]`` (the
        residual stream is gathered there, so the MLP runs on those rows only)."""
        index = ctx.query_index
        residual = x if index is None else gather_positions(x, index)
        if self.post_ln:
            x = self.post_attention_layernorm(residual + self._drop(self.self_attention(x, ctx)))
            return self.post_mlp_layernorm(x + self._drop(self._mlp(x)))  # type: ignore[no-any-return]
        x = residual + self._drop(self.self_attention(self.input_layernorm(x), ctx))
        return x + self._drop(self._mlp(self.post_attention_layernorm(x)))


class TransformerBlock(nn.Module):
    """The layers of one pipeline stage (or virtual chunk) and, on the last, the final LayerNorm.

    With RoPE the block computes the cos/sin tables once per forward (from ``position_ids``,
    default ``0 .. s-1``: every pipeline stage computes them itself) and hands them to its layers.

    ``layer_numbers`` are the global indices of the layers held here; module names use local
    indices ``layers.0 .. layers.n-1`` as Megatron's checkpoints do.
    """

    def __init__(
        self, cfg: ModelConfig, ps: ParallelState, *, layer_numbers: Sequence[int], final_layernorm: bool
    ) -> None:
        super().__init__()
        self.layer_numbers = tuple(layer_numbers)
        self.layers = nn.ModuleList(TransformerLayer(cfg, ps, layer_number=n) for n in self.layer_numbers)
        if final_layernorm and not cfg.post_layernorm:
            self.final_layernorm = layer_norm(cfg, ps)
        self.groups = layer_groups(cfg, len(self.layer_numbers))
        self.rng = ps.rng
        # With sequence parallelism the last stage gathers the sequence for the heads.
        self.sp_group = ps.tp_group if cfg.sequence_parallel and ps.tp_size > 1 else None
        self.gather_output = final_layernorm and self.sp_group is not None
        if self.sp_group is not None and hasattr(self, "final_layernorm"):
            mark_sequence_parallel(self.final_layernorm)
        if cfg.position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(cfg)

    def rotary(self, x: torch.Tensor, position_ids: torch.Tensor | None) -> Rotary | None:
        """RoPE cos/sin for ``x [b, s, h]`` at ``position_ids [b|1, s]`` (None without RoPE)."""
        if not hasattr(self, "rotary_pos_emb"):
            return None
        if position_ids is None:
            s = x.shape[1] * (1 if self.sp_group is None else dist.get_world_size(self.sp_group))
            position_ids = torch.arange(s, device=x.device).unsqueeze(0)
        return self.rotary_pos_emb(position_ids, x.dtype)  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """``x [b, s, h]`` through this stage's layers (and final LayerNorm): ``[b, s, h]``, or
        ``[b, n, h]`` with ``ctx.query_index [b, n]`` (only the last layer is pruned; the layers
        before it need every position as keys and values). See :class:`ForwardContext`."""
        ctx = ctx or ForwardContext()
        rotary = self.rotary(x, ctx.position_ids)
        last = len(self.layers) - 1

        def run(x: torch.Tensor, layers: range) -> torch.Tensor:
            for i in layers:
                layer_ctx = LayerContext(
                    attn_mask=ctx.attn_mask,
                    rotary=rotary,
                    kv_cache=None if ctx.kv_cache is None else ctx.kv_cache.layer(i),
                    query_index=ctx.query_index if i == last else None,
                )
                x = self.layers[i](x, layer_ctx)
            return x

        recompute = self.training and torch.is_grad_enabled()
        for layers, checkpoint in self.groups:
            x = checkpointed(run, self.rng, x, layers) if checkpoint and recompute else run(x, layers)
        if ctx.query_index is not None and not self.layers:
            x = gather_positions(x, ctx.query_index)
        if hasattr(self, "final_layernorm"):
            x = self.final_layernorm(x)
        if self.gather_output:  # the heads' f all-reduces the gradient: backward keeps the shard
            x = gather_from_sequence_region(x, self.sp_group)
        return x
