"""Megatron's architecture flags for Llama-family decoders, parsed into :class:`ModelConfig` fields.

``--normalization RMSNorm --swiglu --position-embedding-type rope --rotary-base 500000
--use-rope-scaling --group-query-attention --num-query-groups 8
--untie-embeddings-and-output-weights --disable-bias-linear [--add-qkv-bias] [--qk-layernorm]``
with ``--ffn-hidden-size``, ``--kv-channels`` and ``--norm-epsilon``, same names and semantics
as Megatron-LM (``--num-query-groups`` counts only with ``--group-query-attention``, whose default
is one group: multi-query attention).
"""

from __future__ import annotations

import argparse
from typing import Any

from pretrain.utils.errors import UserError


def add_architecture_args(g: argparse._ArgumentGroup) -> None:
    """The flags (``--ffn-hidden-size`` is added with the core model flags)."""
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", help="gated SiLU MLP (fc1 holds gate and up)")
    g.add_argument(
        "--position-embedding-type", choices=("learned_absolute", "rope"), default="learned_absolute"
    )
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-seq-len-interpolation-factor", type=float, default=None,
                   help="linear RoPE scaling: positions divided by this factor")  # fmt: skip
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama-3.1 RoPE frequency scaling")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument(
        "--num-query-groups", type=int, default=None, help="key-value heads (with --group-query-attention)"
    )
    g.add_argument("--kv-channels", type=int, default=None, help="per-head size (default hidden/heads)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true")


def architecture_options(args: Any) -> dict[str, Any]:
    """ModelConfig keyword arguments of the flags above (validated by ModelConfig itself)."""
    if args.num_query_groups is not None and not args.group_query_attention:
        raise UserError("--num-query-groups needs --group-query-attention (as in Megatron-LM)")
    groups = (args.num_query_groups or 1) if args.group_query_attention else None
    if args.position_embedding_type != "rope" and (args.use_rope_scaling or args.rotary_percent != 1.0):
        raise UserError("--use-rope-scaling / --rotary-percent need --position-embedding-type rope")
    return dict(
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        swiglu=args.swiglu,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        rotary_seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        use_rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        num_query_groups=groups,
        kv_channels=args.kv_channels,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
    )
