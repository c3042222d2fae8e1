"""The one table of model options: each :class:`~pretrain.config.ModelConfig` field, its Megatron-LM
``args`` name (and flag), its Hugging Face ``config.json`` key per family, and whether we implement,
refuse or merely tolerate a Megatron field.

Everything about an option's name outside the model code is derived from :data:`OPTIONS`:

* :func:`config_kwargs_from_args` -- the ``ModelConfig`` fields a Megatron ``args`` sets (our files
  and upstream Megatron-LM / megatron-core files alike), after :func:`check_refused`;
* :func:`args_from_config` -- its inverse: the Megatron-named ``args`` our checkpoints write;
* ``add_model_flags`` / ``config_kwargs_from_flags`` (:mod:`pretrain.model_option_flags`) --
  ``mlm-pretrain``'s architecture flags (Megatron's spellings) and the fields they give;
* ``hf_kwargs`` / ``config_kwargs_from_hf`` (:mod:`pretrain.model_option_hf`) -- the plain one-to-one ``config.json`` keys of a
  Hugging Face family group (``gpt2``, ``llama`` for Llama/Mistral/Qwen2/Qwen3, ``bert`` for BERT and
  Megatron-BERT); what is not one key to one field (activation names, RoPE scaling dictionaries)
  stays with the family's converter.

A row whose Megatron meaning is not one field to one field (GQA's two fields, the GeLU flavour, QKV
bias, RoPE's older spelling) names a *codec*: a reader from ``args`` and a writer to ``args``
(:mod:`pretrain.model_option_codecs`, which also explains Megatron's two GeLU rules).

``tests/test_model_options.py`` walks the table and round-trips every field through each direction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from pretrain import model_option_codecs as codecs
from pretrain.config import CpuGemm, ModelConfig
from pretrain.model_option_codecs import Args, ArgsReader, ArgsWriter, gelu_kind, is_mcore, need_int
from pretrain.utils.errors import UserError

Status = Literal["implemented", "refused", "numerics"]


@dataclass(frozen=True, kw_only=True)
class Flag:
    """An ``mlm-pretrain`` flag of an option: Megatron's spelling, its argparse behaviour."""

    names: tuple[str, ...]
    kind: Literal["value", "store_true", "store_false"] = "value"
    choices: tuple[str, ...] | None = None
    required: bool = False
    help: str = ""
    parse: Callable[[str], object] | None = None  # argparse type (default: from the field's type)


@dataclass(frozen=True, kw_only=True)
class Option:
    """One row of :data:`OPTIONS` (see the module docstring).

    ``field``: our ``ModelConfig`` field (None for a Megatron field we only refuse or tolerate);
    ``megatron``: the ``args`` name Megatron writes (``aliases``: older spellings, read too);
    ``hf``: family group -> ``config.json`` key, one to one; ``flag``: the ``mlm-pretrain`` flag;
    ``status``: ``implemented``, ``refused`` (any value outside ``harmless`` stops with one line)
    or ``numerics`` (changes precision or speed, never the function); ``read``/``write``: codecs
    for a Megatron meaning that is not one field to one field; ``hf_fixed``: family group -> (the
    only value that group's architecture holds, what it has instead), for the export refusal;
    ``switches``: Hugging Face ``model_type`` -> the value that family fixes, where families with
    the same converter differ by it (the registry's ``Family.switches``, :func:`family_switches`);
    ``tensors``: the per-layer modules that exist only while the option is on.
    """

    field: str | None
    megatron: str | None = None
    aliases: tuple[str, ...] = ()
    hf: Mapping[str, str] = dataclasses.field(default_factory=dict)
    flag: Flag | None = None
    status: Status = "implemented"
    harmless: tuple[object, ...] = ()
    meaning: str = ""
    read: ArgsReader | None = None
    write: ArgsWriter | None = None
    hf_fixed: Mapping[str, tuple[object, str]] = dataclasses.field(default_factory=dict)
    switches: Mapping[str, object] = dataclasses.field(default_factory=dict)
    tensors: tuple[str, ...] = ()


def _value(name: str, *, default: object, cast: Callable[[Any], object]) -> ArgsReader:
    """Reader of a plain field: ``args[name]`` (a falsy value or absence gives ``default``)."""
    return lambda args, source: cast(args[name]) if args.get(name) else default


def _flag(*names: str, kind: Literal["value", "store_true", "store_false"] = "value",
          choices: tuple[str, ...] | None = None, required: bool = False, help: str = "",
          parse: Callable[[str], object] | None = None) -> Flag:  # fmt: skip
    return Flag(names=names, kind=kind, choices=choices, required=required, help=help, parse=parse)


def _write_ffn(cfg: ModelConfig, mcore: bool) -> dict[str, object]:
    return {"ffn_hidden_size": cfg.ffn_size}  # Megatron records the width it ran


# --- the table -------------------------------------------------------------------------------------

_G, _L, _B = "gpt2", "llama", "bert"
_LLAMAS = ("llama", "mistral", "qwen2", "qwen3")  # the model_types of the Llama group's families
# The mixture-of-experts families: each group is layered over "llama" (their attention keys are
# Llama's); a column of theirs replaces llama's for the same option (see hf_kwargs).
_MX, _Q2, _Q3, _OL = "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"
_MOES = (_MX, _Q2, _Q3, _OL)  # their model_types are their group names
_SOFTMAX_ONLY = {g: ("softmax", "scores experts with a softmax") for g in (_MX, _Q2, _Q3, _OL)}
_NO_SCALING = {g: (None, "does not scale the top-k probabilities") for g in (_MX, _Q2, _Q3, _OL)}
_NO_SHARED = {g: (None, "has no shared expert") for g in (_MX, _Q3, _OL)}
OPTIONS: tuple[Option, ...] = (
    # sizes
    Option(field="num_layers", megatron="num_layers", hf={_G: "n_layer", _L: "num_hidden_layers", _B: "num_hidden_layers"},
           flag=_flag("--num-layers", required=True), meaning="layers"),
    Option(field="hidden_size", megatron="hidden_size", hf={_G: "n_embd", _L: "hidden_size", _B: "hidden_size"},
           flag=_flag("--hidden-size", required=True), meaning="hidden size"),
    Option(field="num_attention_heads", megatron="num_attention_heads",
           hf={_G: "n_head", _L: "num_attention_heads", _B: "num_attention_heads"},
           flag=_flag("--num-attention-heads", required=True), meaning="query heads"),
    Option(field="vocab_size", hf={_G: "vocab_size", _L: "vocab_size", _B: "vocab_size"},
           meaning="the tokenizer's true vocabulary (Megatron records it only as padded_vocab_size)"),
    Option(field="max_position_embeddings", megatron="max_position_embeddings",
           hf={_G: "n_positions", _L: "max_position_embeddings", _B: "max_position_embeddings"},
           flag=_flag("--max-position-embeddings", help="default: --seq-length"), meaning="positions"),
    Option(field="ffn_hidden_size", megatron="ffn_hidden_size", hf={_L: "intermediate_size", _B: "intermediate_size"},
           write=_write_ffn, flag=_flag("--ffn-hidden-size"), meaning="MLP width"),
    Option(field="make_vocab_size_divisible_by", megatron="make_vocab_size_divisible_by",
           read=_value("make_vocab_size_divisible_by", default=128, cast=int),
           flag=_flag("--make-vocab-size-divisible-by"), meaning="vocabulary padding multiple (x TP)"),
    # regularisation and initialisation (training only)
    Option(field="hidden_dropout", megatron="hidden_dropout", hf={_G: "resid_pdrop", _B: "hidden_dropout_prob"},
           read=lambda args, source: float(args.get("hidden_dropout", 0.1)),  # type: ignore[arg-type]
           flag=_flag("--hidden-dropout"), meaning="hidden dropout"),
    Option(field="attention_dropout", megatron="attention_dropout",
           hf={_G: "attn_pdrop", _L: "attention_dropout", _B: "attention_probs_dropout_prob"},
           read=lambda args, source: float(args.get("attention_dropout", 0.1)),  # type: ignore[arg-type]
           flag=_flag("--attention-dropout"), meaning="attention dropout"),
    Option(field="init_method_std", megatron="init_method_std",
           hf={_G: "initializer_range", _L: "initializer_range", _B: "initializer_range"},
           read=lambda args, source: float(args.get("init_method_std", 0.02)),  # type: ignore[arg-type]
           flag=_flag("--init-method-std"), meaning="initialisation std"),
    Option(field="recompute_activations", megatron="recompute_activations", status="numerics",
           flag=_flag("--recompute-activations", kind="store_true", help="recompute every layer whole"),
           meaning="activation recomputation"),
    Option(field="recompute_granularity", megatron="recompute_granularity", status="numerics",
           flag=_flag("--recompute-granularity", choices=("full", "selective"),
           help="selective: the core attention only; full: whole layers (with --recompute-method)"),
           meaning="activation recomputation granularity"),
    Option(field="recompute_method", megatron="recompute_method", status="numerics",
           flag=_flag("--recompute-method", choices=("uniform", "block"),
           help="uniform: groups of --recompute-num-layers layers; block: that many layers per stage"),
           meaning="full recomputation method"),
    Option(field="recompute_num_layers", megatron="recompute_num_layers", status="numerics",
           flag=_flag("--recompute-num-layers"), meaning="layers per recomputed group (uniform) or stage (block)"),
    Option(field="sequence_parallel", megatron="sequence_parallel", status="numerics",
           flag=_flag("--sequence-parallel", kind="store_true",
           help="shard norm/dropout regions along the sequence over the TP group"),
           meaning="sequence parallelism"),
    Option(field="fused_kernels", status="numerics",
           flag=_flag("--fused-kernels", kind="store_true",
           help="frozen RMSNorm and SwiGLU as torch.compile'd loops (Megatron's jit_fuser fusions; "
           "compiles on the first step)"),
           meaning="fused elementwise kernels"),
    Option(field="cpu_gemm", status="numerics",
           flag=_flag("--cpu-gemm", choices=get_args(CpuGemm),
           help="library of the frozen fp32 base GEMMs on the CPU (LoRA's adapted linears, the frozen output "
           "layer); auto: oneDNN on x86 CPUs not made by Intel, where MKL runs its AVX2 kernels, else MKL"),
           meaning="CPU GEMM library of frozen weights"),
    Option(field="params_dtype", megatron="params_dtype", status="numerics", meaning="parameter dtype"),
    # the layer
    Option(field="layernorm_epsilon", megatron="norm_epsilon", aliases=("layernorm_epsilon",),
           hf={_G: "layer_norm_epsilon", _L: "rms_norm_eps", _B: "layer_norm_eps"},
           read=codecs.read_epsilon, write=codecs.write_epsilon,
           flag=_flag("--norm-epsilon", "--layernorm-epsilon"), meaning="norm epsilon"),
    Option(field="gelu", megatron="openai_gelu", aliases=("bias_gelu_fusion", "onnx_safe", "use_legacy_models",
           "use_mcore_models"), read=codecs.read_gelu, write=codecs.write_gelu,
           flag=_flag("--gelu", choices=("tanh", "erf"), help="GeLU flavour (mlm-toolkit's flag)"),
           meaning="tanh or erf GeLU (from openai_gelu, bias_gelu_fusion and the model family)"),
    Option(field="normalization", megatron="normalization", read=codecs.read_normalization,
           flag=_flag("--normalization", choices=("LayerNorm", "RMSNorm")), hf_fixed={_G: ("LayerNorm", "has LayerNorm only"), _B: ("LayerNorm", "has LayerNorm only"), _L: ("RMSNorm", "has RMSNorm only")},
           meaning="LayerNorm or RMSNorm"),
    Option(field="swiglu", megatron="swiglu", flag=_flag("--swiglu", kind="store_true",
           help="gated SiLU MLP (fc1 holds gate and up)"), hf_fixed={_G: (False, "has an ungated MLP"), _B: (False, "has an ungated MLP"), _L: (True, "has a SwiGLU MLP")},
           meaning="SwiGLU MLP"),
    Option(field="squared_relu", megatron="squared_relu", flag=_flag("--squared-relu", kind="store_true"),
           meaning="relu(x)^2 MLP"),
    Option(field="position_embedding_type", megatron="position_embedding_type",
           aliases=("use_rotary_position_embeddings", "add_position_embedding"), read=codecs.read_position,
           write=codecs.write_position, flag=_flag("--position-embedding-type", choices=("learned_absolute", "rope")),
           hf_fixed={_G: ("learned_absolute", "has learned positions"), _B: ("learned_absolute", "has learned positions"), _L: ("rope", "has RoPE only")},
           switches={"gpt2": "learned_absolute", **dict.fromkeys((*_LLAMAS, *_MOES), "rope")}, meaning="learned_absolute or rope"),
    Option(field="rotary_base", megatron="rotary_base", read=_value("rotary_base", default=10000.0, cast=float),
           flag=_flag("--rotary-base"), meaning="RoPE base"),
    Option(field="rotary_percent", megatron="rotary_percent", read=_value("rotary_percent", default=1.0, cast=float),
           flag=_flag("--rotary-percent"), hf_fixed={_L: (1.0, "rotates whole heads")},
           meaning="partial rotary"),
    Option(field="rotary_seq_len_interpolation_factor", megatron="rotary_seq_len_interpolation_factor",
           read=codecs.read_interpolation, flag=_flag("--rotary-seq-len-interpolation-factor",
           help="linear RoPE scaling: positions divided by this factor"), meaning="linear RoPE scaling"),
    Option(field="use_rope_scaling", megatron="use_rope_scaling",
           flag=_flag("--use-rope-scaling", kind="store_true", help="Llama-3.1 RoPE frequency scaling"),
           meaning="Llama-3.1 RoPE scaling"),
    Option(field="rope_scaling_factor", megatron="rope_scaling_factor",
           read=_value("rope_scaling_factor", default=8.0, cast=float), flag=_flag("--rope-scaling-factor"),
           meaning="Llama-3.1 RoPE scaling factor"),
    Option(field="rope_low_freq_factor", meaning="Llama-3.1 RoPE low-frequency factor (fixed 1 in Megatron)"),
    Option(field="rope_high_freq_factor", meaning="Llama-3.1 RoPE high-frequency factor (fixed 4 in Megatron)"),
    Option(field="rope_original_max_position_embeddings",
           meaning="Llama-3.1 RoPE original context (fixed 8192 in Megatron)"),
    Option(field="num_query_groups", megatron="num_query_groups", aliases=("group_query_attention",),
           read=codecs.read_groups, write=codecs.write_groups, meaning="key-value heads (GQA)"),
    Option(field="kv_channels", megatron="kv_channels", read=codecs.read_kv_channels, write=codecs.write_kv_channels,
           flag=_flag("--kv-channels", help="per-head size (default hidden/heads)"), meaning="per-head channels"),
    Option(field="untie_embeddings_and_output_weights", megatron="untie_embeddings_and_output_weights",
           flag=_flag("--untie-embeddings-and-output-weights", kind="store_true"), hf_fixed={_B: (False, "ties its decoder to the embeddings")},
           meaning="untied output layer"),
    Option(field="add_bias_linear", megatron="add_bias_linear", read=codecs.read_bias,
           flag=_flag("--disable-bias-linear", kind="store_false"), hf_fixed={_L: (False, "has no o_proj or MLP biases; --disable-bias-linear")},
           meaning="linear biases"),
    Option(field="add_qkv_bias", megatron="add_qkv_bias", read=codecs.read_qkv_bias, write=codecs.write_qkv_bias,
           flag=_flag("--add-qkv-bias", kind="store_true"), hf={_Q2: "qkv_bias"},
           hf_fixed={g: (False, "has no QKV bias") for g in (_MX, _Q3, _OL)},
           switches={**dict.fromkeys(_LLAMAS, False), "qwen2": True, _MX: False},
           meaning="QKV bias without other biases (Qwen2)"),
    Option(field="qk_layernorm", megatron="qk_layernorm", flag=_flag("--qk-layernorm", kind="store_true"),
           hf_fixed={_G: (False, "has no QK-norm"), _B: (False, "has no QK-norm"), _MX: (False, "has no QK-norm"),
                     _Q2: (False, "has no QK-norm"), _Q3: (True, "has per-head QK-norm"),
                     _OL: (False, "has full-width QK-norm, not per head")},
           switches={**dict.fromkeys(_LLAMAS, False), "qwen3": True, **dict.fromkeys(_MOES, False), _Q3: True},
           tensors=("q_layernorm", "k_layernorm"),
           meaning="per-head query/key norms (Qwen3)"),
    Option(field="qk_layernorm_full_width", flag=_flag("--qk-layernorm-full-width", kind="store_true",
           help="RMSNorm over the whole query and key projections, not per head (OLMoE; mlm-toolkit's flag)"),
           hf_fixed={_G: (False, "has no QK-norm"), _L: (False, "has no full-width QK-norm"), _B: (False, "has no QK-norm"),
                     _MX: (False, "has no QK-norm"), _Q2: (False, "has no QK-norm"),
                     _Q3: (False, "has per-head QK-norm, not full-width"), _OL: (True, "has full-width QK-norm")},
           switches={**dict.fromkeys(_MOES, False), _OL: True}, tensors=("q_full_layernorm", "k_full_layernorm"),
           meaning="full-width query/key RMSNorm (OLMoE)"),
    # mixture of experts (Megatron's MoE flags and semantics; pretrain.models.moe)
    Option(field="num_experts", megatron="num_experts", read=_value("num_experts", default=None, cast=int),
           flag=_flag("--num-experts", help="routed experts per MoE layer (default: dense MLPs)"),
           hf={_MX: "num_local_experts", _Q2: "num_experts", _Q3: "num_experts", _OL: "num_experts"},
           hf_fixed={_G: (None, "has dense MLPs only"), _L: (None, "has dense MLPs only"), _B: (None, "has dense MLPs only")},
           meaning="routed experts"),
    Option(field="moe_router_topk", megatron="moe_router_topk", read=_value("moe_router_topk", default=2, cast=int),
           hf={g: "num_experts_per_tok" for g in (_MX, _Q2, _Q3, _OL)}, flag=_flag("--moe-router-topk"),
           meaning="experts per token"),
    Option(field="moe_ffn_hidden_size", megatron="moe_ffn_hidden_size",
           read=_value("moe_ffn_hidden_size", default=None, cast=int), flag=_flag("--moe-ffn-hidden-size"),
           hf={_MX: "intermediate_size", _Q2: "moe_intermediate_size", _Q3: "moe_intermediate_size", _OL: "intermediate_size"},
           meaning="routed expert width"),
    Option(field="moe_layer_freq", megatron="moe_layer_freq", read=codecs.read_layer_freq, write=codecs.write_layer_freq,
           flag=_flag("--moe-layer-freq", parse=codecs.parse_layer_freq, help="every N-th layer is MoE, or a 0/1 list per layer"),
           meaning="which layers are MoE"),
    Option(field="moe_router_pre_softmax", megatron="moe_router_pre_softmax",
           flag=_flag("--moe-router-pre-softmax", kind="store_true"),
           hf_fixed={_MX: (False, "renormalises the top-k probabilities")},  # the others: norm_topk_prob (converter)
           switches={_MX: False},
           meaning="softmax before top-k (no renormalisation)"),
    Option(field="moe_router_score_function", megatron="moe_router_score_function",
           read=_value("moe_router_score_function", default="softmax", cast=str),
           flag=_flag("--moe-router-score-function", choices=("softmax", "sigmoid")), hf_fixed=_SOFTMAX_ONLY,
           meaning="router score function"),
    Option(field="moe_router_topk_scaling_factor", megatron="moe_router_topk_scaling_factor",
           read=_value("moe_router_topk_scaling_factor", default=None, cast=float),
           flag=_flag("--moe-router-topk-scaling-factor"), hf_fixed=_NO_SCALING, meaning="top-k probability scaling"),
    Option(field="moe_shared_expert_intermediate_size", megatron="moe_shared_expert_intermediate_size",
           read=_value("moe_shared_expert_intermediate_size", default=None, cast=int),
           flag=_flag("--moe-shared-expert-intermediate-size"), hf={_Q2: "shared_expert_intermediate_size"},
           hf_fixed=_NO_SHARED, switches={_MX: None}, meaning="shared expert width"),
    Option(field="moe_shared_expert_gate", megatron="moe_shared_expert_gate",
           flag=_flag("--moe-shared-expert-gate", kind="store_true"),
           hf_fixed={_MX: (False, "has no shared expert"), _Q2: (True, "gates its shared expert"),
                     _Q3: (False, "has no shared expert"), _OL: (False, "has no shared expert")},
           switches={_Q2: True}, meaning="sigmoid-gated shared expert (Qwen2-MoE)"),
    Option(field="moe_router_load_balancing_type", megatron="moe_router_load_balancing_type",
           read=codecs.read_load_balancing, flag=_flag("--moe-router-load-balancing-type", choices=("aux_loss", "none")),
           meaning="router load balancing (training)"),
    Option(field="moe_aux_loss_coeff", megatron="moe_aux_loss_coeff", read=codecs.read_aux_coeff,
           flag=_flag("--moe-aux-loss-coeff"), meaning="load-balancing loss weight (training)"),
    Option(field="moe_z_loss_coeff", megatron="moe_z_loss_coeff", read=_value("moe_z_loss_coeff", default=None, cast=float),
           flag=_flag("--moe-z-loss-coeff"), meaning="router z-loss weight (training)"),
    Option(field="moe_expert_capacity_factor", megatron="moe_expert_capacity_factor",
           read=_value("moe_expert_capacity_factor", default=None, cast=float),
           flag=_flag("--moe-expert-capacity-factor", help="expert capacity (default: dropless)"),
           hf_fixed={g: (None, "routes without capacity (dropless)") for g in _MOES},
           meaning="expert capacity with token dropping"),
    Option(field="moe_token_drop_policy", megatron="moe_token_drop_policy",
           read=_value("moe_token_drop_policy", default="probs", cast=str),
           flag=_flag("--moe-token-drop-policy", choices=("probs", "position")), meaning="token drop policy"),
    # BERT's arrangement (from the model kind and shapes, never from Megatron args)
    Option(field="bidirectional", hf_fixed={_G: (False, "is causal"), _L: (False, "is causal"), _B: (True, "is bidirectional")},
           meaning="bidirectional attention (BERT)"),
    Option(field="num_tokentypes", hf={_B: "type_vocab_size"}, hf_fixed={_G: (0, "has no token-type embeddings"), _L: (0, "has no token-type embeddings")},
           meaning="token types (BERT)"),
    Option(field="post_layernorm", hf_fixed={_G: (False, "is pre-LN"), _L: (False, "is pre-norm")},
           switches={"bert": True, "megatron-bert": False},
           meaning="post-LN arrangement (original BERT)"),
    # zero-centred norm weights: a tensor transform of the readers, never a ModelConfig field
    Option(field=None, megatron="apply_layernorm_1p", aliases=("layernorm_zero_centered_gamma",),
           meaning="zero-centred gamma (weight + 1), undone on reading"),
    # refused: any value outside `harmless` stops with one line naming the field
    *(Option(field=None, megatron=name, status="refused", harmless=ok, meaning=what) for name, (ok, what) in {
        "apply_residual_connection_post_layernorm": ((False, None), "residual from the norm output"),
        "rotary_interleaved": ((False, None), "interleaved RoPE"),
        "moe_router_enable_expert_bias": ((False, None), "aux-loss-free expert bias routing"),
        "moe_router_num_groups": ((None,), "group-limited routing"),
        "moe_router_group_topk": ((None,), "group-limited routing"),
        "moe_input_jitter_eps": ((None,), "router input jitter"),
        "moe_apply_probs_on_input": ((False, None), "router probabilities applied to the expert input"),
        "moe_latent_size": ((None,), "latent mixture of experts"),
        "moe_router_force_load_balancing": ((False, None), "forced (random) load balancing"),
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
    }.items()),
    # tolerated: precision and speed only
    *(Option(field=None, megatron=name, status="numerics", meaning="precision or speed only") for name in (
        "apply_query_key_layer_scaling", "attention_softmax_in_fp32", "fp32_residual_connection",
        "masked_softmax_fusion", "bias_dropout_fusion", "bias_swiglu_fusion", "gradient_accumulation_fusion",
        "fp16", "bf16", "transformer_impl", "attention_backend",
        # added after core_v0.16: fusions and low-precision paths of the same function
        "fused_residual_rmsnorm", "use_transformer_engine_op_fuser", "flash_attention_version", "fp8_output_proj",
        "fp4_param_gather", "mlp_chunks_for_training",
        # mixture of experts: kernels, dispatch and logging of the same function
        "moe_grouped_gemm", "moe_use_legacy_grouped_gemm", "moe_token_dispatcher_type", "moe_router_dtype",
        "moe_permute_fusion", "moe_router_fusion", "moe_shared_expert_overlap", "moe_layer_recompute",
        "moe_enable_deepep", "moe_flex_dispatcher_backend", "moe_per_layer_logging", "moe_router_padding_for_fp8",
        "moe_router_padding_for_quantization", "moe_deepep_num_sms", "moe_hybridep_num_sms",
        "moe_pad_expert_input_to_capacity",  # zero-weight padding tokens: the same function
    )),
)  # fmt: skip
BY_FIELD: dict[str, Option] = {o.field: o for o in OPTIONS if o.field is not None}
REFUSED: dict[str, Option] = {o.megatron: o for o in OPTIONS if o.status == "refused" and o.megatron}
# The fields config_kwargs_from_args reads (the rest come from shapes, the tokenizer and the kind).
ARGS_FIELDS = tuple(
    o.field for o in OPTIONS
    if o.field and o.status == "implemented" and (o.megatron or o.read)
    and o.field not in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
                        "ffn_hidden_size")
)  # fmt: skip


# --- Megatron args ---------------------------------------------------------------------------------


def check_refused(args: Args, source: str) -> None:
    """Stop on the first field we do not implement set to a value that changes the function."""
    for key, option in REFUSED.items():
        if key in args and args[key] not in option.harmless:
            raise UserError(
                f"{source}: args.{key}={args[key]!r}: {option.meaning} is not supported by mlm-toolkit models"
            )


def config_kwargs_from_args(args: Args, *, source: str) -> dict[str, object]:
    """The ``ModelConfig`` fields of :data:`ARGS_FIELDS` that ``args`` imply (refusals first).

    The sizes (layers, hidden, heads, positions, MLP width) are left to the caller, which may take
    them from tensor shapes where old files lack them.
    """
    check_refused(args, source)
    out: dict[str, object] = {}
    for name in ARGS_FIELDS:
        option = BY_FIELD[name]
        if option.read is not None:
            out[name] = option.read(args, source)
        elif option.megatron is not None:
            out[name] = bool(args.get(option.megatron))  # a plain switch
    if out["swiglu"] and out["squared_relu"]:
        raise UserError(f"{source}: args set both swiglu and squared_relu")
    return out


def args_from_config(cfg: ModelConfig, *, mcore: bool) -> dict[str, object]:
    """The Megatron ``args`` fields (both spellings where Megatron has two) that make upstream
    Megatron-LM -- and :func:`config_kwargs_from_args` -- build ``cfg``'s architecture. ``mcore``:
    the file's module names are megatron-core's (its GeLU rule differs)."""
    out: dict[str, object] = {"apply_layernorm_1p": False}
    for option in OPTIONS:
        if option.field is None or option.status != "implemented" or option.megatron is None:
            continue
        if option.write is not None:
            out.update(option.write(cfg, mcore))
        else:
            out[option.megatron] = getattr(cfg, option.field)
    return out


def layernorm_1p(args: Args) -> bool:
    """Whether the file's norm weights are zero-centred (Megatron ``apply_layernorm_1p``)."""
    return bool(args.get("apply_layernorm_1p") or args.get("layernorm_zero_centered_gamma"))


__all__ = [
    "BY_FIELD",
    "OPTIONS",
    "REFUSED",
    "Flag",
    "Option",
    "args_from_config",
    "check_refused",
    "config_kwargs_from_args",
    "gelu_kind",
    "is_mcore",
    "layernorm_1p",
    "need_int",
]
