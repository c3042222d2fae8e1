"""Model FLOPs per iteration: Megatron-LM's ``num_floating_point_operations`` (GQA, SwiGLU,
``kv_channels``, ``ffn_hidden_size``), which reduces to the paper's formula for GPT-2.

Per layer and token, one forward pass costs ``2 x`` the weights of its matmuls plus the attention
scores, i.e. with ``q = kv_channels x heads`` (query width), ``g / n`` query groups per head and
``f`` the FFN width (x 3/2 for SwiGLU's three matrices instead of two)::

    4 h^2 [ (1 + g/n + s/h) q/h + (f/h) x gated ]     (QKV + output projection, QK^T and AV, MLP)

Training takes 3 passes of that (forward, data gradient, weight gradient), 4 with full activation
recomputation (a second forward), and the output layer adds ``6 s h V`` per sequence (never
recomputed). For GPT-2 (``q = h``, ``g = n``, ``f = 4h``) this is Narayanan et al. 2021, eq. 3:
``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` with recomputation. Mixture-of-experts layers count
the experts a token is routed to (:func:`mlp_width`), so TFLOP/s are those of active parameters.
"""

from __future__ import annotations

from pretrain.config import ModelConfig


def mlp_width(cfg: ModelConfig, layer_number: int) -> int:
    """The MLP width a token passes through in layer ``layer_number``: the dense ``ffn_size``, or
    for a mixture-of-experts layer its *active* width, ``topk x moe_ffn_size`` plus the shared
    expert (Megatron's ``moe_layer_flops``; the router's ``h x E`` GEMM is not counted, as there)."""
    if not cfg.is_moe_layer(layer_number):
        return cfg.ffn_size
    return cfg.moe_router_topk * cfg.moe_ffn_size + (cfg.moe_shared_expert_intermediate_size or 0)


def layer_forward_flops_per_token(cfg: ModelConfig, *, seq_length: int, layer_number: int = 0) -> float:
    """FLOPs of one forward pass of transformer layer ``layer_number``, per token."""
    h, s, n = cfg.hidden_size, seq_length, cfg.num_attention_heads
    q = cfg.head_dim * n
    gated = 1.5 if cfg.swiglu else 1.0
    attention = (1 + cfg.query_groups / n + s / h) * q / h
    return 4.0 * h * h * (attention + mlp_width(cfg, layer_number) / h * gated)


def gpt_flops_per_iteration(
    cfg: ModelConfig, *, global_batch: int, seq_length: int, padded_vocab: int
) -> float:
    """Model FLOPs of one training iteration of ``global_batch`` sequences of ``seq_length``."""
    tokens = float(global_batch) * seq_length
    # a second forward where every layer is recomputed whole (--recompute-activations, or full
    # uniform recomputation); block recomputation depends on the pipeline split: counted as none
    every_layer = cfg.recompute_granularity == "full" and cfg.recompute_method == "uniform"
    passes = 4 if cfg.recompute_activations or every_layer else 3
    layers = passes * sum(
        layer_forward_flops_per_token(cfg, seq_length=seq_length, layer_number=i)
        for i in range(cfg.num_layers)
    )
    logits = 6.0 * cfg.hidden_size * padded_vocab
    return tokens * (layers + logits)
