"""What an upstream ``args`` field means for the function a checkpoint computes: the one list.

Every Megatron-LM / megatron-core ``args`` field that changes what the model computes is in one
of the tables below, and nowhere else:

* :data:`ARCHITECTURE` -- implemented: read into :class:`~pretrain.config.ModelConfig` (or, for
  ``apply_layernorm_1p``, into a tensor transform of the reader: zero-centred gamma, weight + 1).
* :data:`REFUSED` -- not implemented: a file that sets one of them to a value other than its
  harmless default stops with one line naming the field.
* :data:`NUMERICS_ONLY` -- fields that change precision or speed but not the function.

:func:`architecture_from_args` reads the implemented fields; :func:`architecture_args` is its
inverse (what our checkpoints write), so that a checkpoint's Megatron-named ``args`` describe the
model it holds.

The GeLU flavour differs between the two Megatron model families (see :func:`gelu_kind`):
legacy models run tanh GeLU for ``openai_gelu`` and for the fused bias-GeLU kernel; megatron-core
ignores ``openai_gelu`` and runs exact ``F.gelu`` unless the fused bias-GeLU kernel (tanh) is on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pretrain.config import ModelConfig
from pretrain.utils.errors import UserError

# field -> what it means (implemented by :func:`architecture_from_args`)
ARCHITECTURE: dict[str, str] = {
    "num_layers": "layers", "hidden_size": "hidden size", "num_attention_heads": "query heads",
    "ffn_hidden_size": "MLP width", "kv_channels": "per-head channels",
    "group_query_attention": "GQA on/off", "num_query_groups": "key-value heads",
    "max_position_embeddings": "positions", "normalization": "LayerNorm or RMSNorm",
    "layernorm_epsilon": "norm epsilon", "norm_epsilon": "norm epsilon (older spelling)",
    "apply_layernorm_1p": "zero-centred gamma (weight + 1)",
    "layernorm_zero_centered_gamma": "zero-centred gamma (weight + 1)",
    "swiglu": "SwiGLU MLP", "squared_relu": "relu(x)^2 MLP", "openai_gelu": "tanh GeLU (legacy models only)",
    "bias_gelu_fusion": "fused bias-GeLU kernel = tanh GeLU", "onnx_safe": "erf GeLU (legacy)",
    "position_embedding_type": "learned_absolute or rope",
    "use_rotary_position_embeddings": "rope (older spelling)", "add_position_embedding": "learned positions",
    "rotary_base": "RoPE base", "rotary_percent": "partial rotary",
    "rotary_seq_len_interpolation_factor": "linear RoPE scaling",
    "use_rope_scaling": "Llama-3.1 RoPE scaling", "rope_scaling_factor": "Llama-3.1 RoPE scaling factor",
    "untie_embeddings_and_output_weights": "untied output layer",
    "add_bias_linear": "linear biases", "add_qkv_bias": "QKV bias", "qk_layernorm": "query/key norms",
    "use_legacy_models": "legacy vs megatron-core model (GeLU flavour)",
    "use_mcore_models": "megatron-core model (older spelling)",
}  # fmt: skip
# field -> (harmless value(s), what it is): any other value is refused
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "apply_residual_connection_post_layernorm": ((False, None), "residual from the norm output"),
    "rotary_interleaved": ((False, None), "interleaved RoPE"),
    "num_experts": ((None, 0, 1), "mixture of experts"),
    "multi_latent_attention": ((False, None), "multi-latent attention"),
    "qk_l2_norm": ((False, None), "L2 query/key norm"),
    "window_size": ((None,), "sliding-window attention"),
    "softmax_type": (("vanilla", None), "attention softmax variant"),
    "attention_output_gate": ((False, None), "gated attention output"),
    "quick_geglu": ((False, None), "quick GeGLU"),
    "mtp_num_layers": ((None, 0), "multi-token prediction layers"),
    "heterogeneous_layers_config_path": ((None,), "heterogeneous layers"),
    "hybrid_override_pattern": ((None,), "hybrid Mamba layers"),
    "is_hybrid_model": ((False, None), "hybrid Mamba model"),
    "no_rope_freq": ((None,), "layers without RoPE"),
    "mrope_section": ((None,), "multimodal RoPE"),
    "experimental_attention_variant": ((None,), "experimental attention"),
    "glu_linear_offset": ((0.0, 0, None), "GLU linear offset"),
    "activation_func_clamp_value": ((None,), "clamped activation"),
    # added after core_v0.16 (docs/megatron-core-versions.md)
    "use_mup": ((False, None), "muP scaling (attention 1/d, logit multiplier)"),
    "mup_embedding_mult": ((1.0, None), "muP embedding multiplier"),
    "mup_output_mult": ((1.0, None), "muP logit multiplier"),
    "softmax_scale": ((None,), "custom attention softmax scale"),
    "hybrid_layer_pattern": ((None,), "hybrid Mamba layers"),
    "mtp_hybrid_override_pattern": ((None,), "hybrid multi-token prediction layers"),
    "use_grouped_gemm_for_dense_mlp": ((False, None), "dense MLP as one grouped GEMM (TE op-fuser layout)"),
    "gtp_weight_remat_size": ((1, None), "weights sharded beyond TP (GTP)"),
}
NUMERICS_ONLY = (
    "apply_query_key_layer_scaling", "attention_softmax_in_fp32", "fp32_residual_connection",
    "masked_softmax_fusion", "bias_dropout_fusion", "bias_swiglu_fusion", "gradient_accumulation_fusion",
    "fp16", "bf16", "params_dtype", "transformer_impl", "attention_backend",
    # added after core_v0.16: fusions and low-precision paths of the same function
    "fused_residual_rmsnorm", "use_transformer_engine_op_fuser", "flash_attention_version", "fp8_output_proj",
    "fp4_param_gather", "mlp_chunks_for_training",
)  # fmt: skip
# Needed fields and the Megatron-LM training flag that sets each (named in the one-line refusal).
FLAGS = {
    "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups", "max_position_embeddings": "--max-position-embeddings",
    "ffn_hidden_size": "--ffn-hidden-size",
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """The :class:`~pretrain.config.ModelConfig` options an ``args`` implies (plus ``layernorm_1p``)."""

    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    layernorm_1p: bool = False  # stored norm weights are zero-centred: the reader adds 1
    swiglu: bool = False
    squared_relu: bool = False
    gelu: str = "erf"
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rotary_seq_len_interpolation_factor: float | None = None
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    num_query_groups: int | None = None
    kv_channels: int | None = None
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False


def check_refused(args: Mapping[str, Any], source: str) -> None:
    """Stop on the first field we do not implement (one line naming it)."""
    for key, (ok, what) in REFUSED.items():
        if key in args and args[key] not in ok:
            raise UserError(
                f"{source}: args.{key}={args[key]!r}: {what} is not supported by mlm-toolkit models"
            )


def is_mcore(args: Mapping[str, Any]) -> bool:
    """Whether ``args`` describe a megatron-core model (``use_legacy_models`` false).

    megatron-core 0.18 removed the legacy models and ``use_legacy_models`` with them; its args keep
    ``deprecated_use_mcore_models`` (the dead ``--use-mcore-models`` flag), so they are megatron-core.
    """
    if "use_legacy_models" in args:
        return not args["use_legacy_models"]
    if "use_mcore_models" in args:
        return bool(args["use_mcore_models"])
    return "deprecated_use_mcore_models" in args


def gelu_kind(args: Mapping[str, Any], *, mcore: bool) -> str:
    """``tanh`` or ``erf``: what GeLU the model ran (see the module docstring)."""
    fused = bool(args.get("bias_gelu_fusion")) and bool(args.get("add_bias_linear", True))
    if mcore:
        return "tanh" if fused else "erf"
    if args.get("openai_gelu"):
        return "tanh"
    if args.get("onnx_safe"):
        return "erf"
    return "tanh" if fused else "erf"


def need(args: Mapping[str, Any], key: str, source: str) -> Any:
    """``args[key]``, or one line naming the field and the flag that supplies it."""
    value = args.get(key)
    if value is None:
        flag = FLAGS.get(key, "--" + key.replace("_", "-"))
        raise UserError(f"{source}: args lack {key} (Megatron-LM's {flag}), needed to read this checkpoint")
    return value


def _position_type(args: Mapping[str, Any], source: str) -> str:
    pos = str(args.get("position_embedding_type") or "learned_absolute")
    if args.get("use_rotary_position_embeddings"):
        pos = "rope"
    if pos not in ("learned_absolute", "rope"):
        raise UserError(
            f"{source}: args.position_embedding_type={pos}: only learned_absolute and rope are supported"
        )
    if pos == "learned_absolute" and args.get("add_position_embedding") is False:
        raise UserError(f"{source}: args.add_position_embedding=False without rope: no position information")
    return pos


def architecture_from_args(args: Mapping[str, Any], *, source: str) -> Architecture:
    """Everything in :data:`ARCHITECTURE` that ``args`` set; refuses :data:`REFUSED` fields first."""
    check_refused(args, source)
    norm = str(args.get("normalization") or "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        raise UserError(f"{source}: args.normalization={norm}: only LayerNorm and RMSNorm are supported")
    swiglu, squared = bool(args.get("swiglu")), bool(args.get("squared_relu"))
    if swiglu and squared:
        raise UserError(f"{source}: args set both swiglu and squared_relu")
    groups = args.get("num_query_groups") if args.get("group_query_attention") else None
    if args.get("group_query_attention"):
        groups = need(args, "num_query_groups", source)
    bias = args.get("add_bias_linear", True) is not False
    interp = args.get("rotary_seq_len_interpolation_factor")
    return Architecture(
        normalization=norm,
        layernorm_epsilon=float(args.get("layernorm_epsilon", args.get("norm_epsilon", 1e-5)) or 1e-5),
        layernorm_1p=layernorm_1p(args),
        swiglu=swiglu,
        squared_relu=squared,
        gelu=gelu_kind(args, mcore=is_mcore(args)),
        position_embedding_type=_position_type(args, source),
        rotary_base=float(args.get("rotary_base") or 10000),
        rotary_percent=float(args.get("rotary_percent") or 1.0),
        rotary_seq_len_interpolation_factor=None if interp in (None, 1, 1.0) else float(interp),
        use_rope_scaling=bool(args.get("use_rope_scaling")),
        rope_scaling_factor=float(args.get("rope_scaling_factor") or 8.0),
        num_query_groups=int(groups) if groups else None,
        kv_channels=int(args["kv_channels"]) if args.get("kv_channels") else None,
        untie_embeddings_and_output_weights=bool(args.get("untie_embeddings_and_output_weights")),
        add_bias_linear=bias,
        add_qkv_bias=bool(args.get("add_qkv_bias")) and not bias,
        qk_layernorm=bool(args.get("qk_layernorm")),
    )


def architecture_args(cfg: ModelConfig, *, mcore: bool) -> dict[str, Any]:
    """The inverse of :func:`architecture_from_args`: the Megatron ``args`` fields (both spellings
    where Megatron has two) that make upstream Megatron-LM -- and our upstream reader -- build
    ``cfg``'s architecture. ``mcore``: the file's module names are megatron-core's.

    Megatron-core runs exact GeLU unless the fused bias-GeLU kernel (tanh) is on, so a tanh model
    with biases is written with ``bias_gelu_fusion``; legacy models take ``openai_gelu``.
    ``add_qkv_bias`` is whether the QKV projection has a bias (Megatron adds one for
    ``add_bias_linear or add_qkv_bias``).
    """
    tanh = cfg.gelu == "tanh"
    rope = cfg.position_embedding_type == "rope"
    gqa = cfg.num_query_groups
    return {
        "normalization": cfg.normalization,
        "layernorm_epsilon": cfg.layernorm_epsilon,
        "norm_epsilon": cfg.layernorm_epsilon,
        "apply_layernorm_1p": False,
        "swiglu": cfg.swiglu,
        "squared_relu": cfg.squared_relu,
        "openai_gelu": tanh,
        "bias_gelu_fusion": mcore and tanh and cfg.add_bias_linear,
        "position_embedding_type": cfg.position_embedding_type,
        "add_position_embedding": not rope,
        "use_rotary_position_embeddings": False,
        "rotary_base": cfg.rotary_base,
        "rotary_percent": cfg.rotary_percent,
        "rotary_seq_len_interpolation_factor": cfg.rotary_seq_len_interpolation_factor,
        "use_rope_scaling": cfg.use_rope_scaling,
        "rope_scaling_factor": cfg.rope_scaling_factor,
        "kv_channels": cfg.head_dim,
        "group_query_attention": bool(gqa) and gqa != cfg.num_attention_heads,
        "num_query_groups": gqa or cfg.num_attention_heads,
        "untie_embeddings_and_output_weights": cfg.untie_embeddings_and_output_weights,
        "add_bias_linear": cfg.add_bias_linear,
        "add_qkv_bias": cfg.qkv_bias,
        "qk_layernorm": cfg.qk_layernorm,
    }


def layernorm_1p(args: Mapping[str, Any]) -> bool:
    """Whether the file's norm weights are zero-centred (Megatron ``apply_layernorm_1p``)."""
    return bool(args.get("apply_layernorm_1p") or args.get("layernorm_zero_centered_gamma"))


def is_zero_centred_norm(name: str) -> bool:
    """Norm weights that ``apply_layernorm_1p`` stores minus 1 (every LayerNorm/RMSNorm gamma)."""
    return name.endswith("layernorm.weight")


_HEAD = "word_embeddings_for_head.weight"
OUTPUT_LAYER = "language_model.output_layer.weight"


def untie_head_names(local_to_key: dict[str, str]) -> dict[str, str]:
    """For untied models: the output layer (megatron-core ``output_layer``) is our ``output_layer``."""
    out = dict(local_to_key)
    if _HEAD in out and OUTPUT_LAYER not in out:
        out[OUTPUT_LAYER] = out.pop(_HEAD)
    return out


def check_bert_gelu(args: Mapping[str, Any], arch: Architecture, source: str) -> None:
    """Refuse a BERT whose MLM head runs another GeLU than its layers (we run one GeLU).

    The head's GeLU ignores the fused bias-GeLU kernel: megatron-core's ``BertLMHead`` always runs
    exact ``F.gelu``; the legacy head runs tanh only for ``openai_gelu``. So ``bias_gelu_fusion``
    without ``openai_gelu`` (tanh layers, exact head) has no mlm-toolkit counterpart.
    """
    head = "tanh" if not is_mcore(args) and args.get("openai_gelu") else "erf"
    if head != arch.gelu:
        raise UserError(
            f"{source}: args.bias_gelu_fusion={args.get('bias_gelu_fusion')!r} on a BERT: its layers run "
            f"{arch.gelu} GeLU but its MLM head {head} GeLU; mlm-toolkit BERT runs one GeLU throughout"
        )
