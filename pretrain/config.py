"""Model and dtype configuration: frozen, keyword-only dataclasses validated on creation.

:class:`DTypeFlags` is also the shared ``--dtype``/``--bf16``/``--fp16`` flag group (its fields'
``metadata``). The parallel layout is :class:`pretrain.parallel.config.ParallelConfig`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, get_args

from pretrain.utils.errors import UserError
from pretrain.utils.flag_groups import flag_meta

GeluKind = Literal["tanh", "erf"]
Normalization = Literal["LayerNorm", "RMSNorm"]
PositionEmbeddingType = Literal["learned_absolute", "rope"]
DTypeName = Literal["float32", "bfloat16", "float16"]
RouterScore = Literal["softmax", "sigmoid"]
LoadBalancing = Literal["aux_loss", "none"]
DropPolicy = Literal["probs", "position"]
RecomputeGranularity = Literal["full", "selective"]
CpuGemm = Literal["auto", "mkl", "onednn"]  # ModelConfig.cpu_gemm (pretrain.models.cpu_gemm)
RecomputeMethod = Literal["uniform", "block"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A GPT-2 / BERT style transformer (paper section 3, Megatron's legacy model), with the
    options of Llama-family decoders under Megatron's own names and semantics.

    Defaults are GPT-2's. A Llama-style decoder sets ``normalization="RMSNorm"``, ``swiglu``,
    ``position_embedding_type="rope"``, ``num_query_groups`` (GQA; ``None`` = one group per head),
    ``untie_embeddings_and_output_weights`` and ``add_bias_linear=False`` (Megatron's
    ``--disable-bias-linear``); Qwen2 adds ``add_qkv_bias``, Qwen3 ``qk_layernorm``.
    ``layernorm_epsilon`` is Megatron's ``--norm-epsilon`` for either normalization.

    ``vocab_size`` is the tokenizer's true vocabulary; the embedding is padded to a multiple of
    ``make_vocab_size_divisible_by * tp`` (see :func:`pretrain.tensor_parallel.vocab.padded_vocab_size`)
    and padded rows never take probability mass.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    gelu: GeluKind = "tanh"
    recompute_activations: bool = False  # every layer recomputed whole (--recompute-granularity full)
    # Activation memory (Korthikanti et al. 2022), Megatron's flags: speed and memory, never the
    # function. "selective" recomputes the core attention (softmax, dropout, AV) only; "full" the
    # layers chosen by recompute_method: "uniform" checkpoints groups of recompute_num_layers
    # layers, "block" the first recompute_num_layers layers of each pipeline stage (or chunk).
    recompute_granularity: RecomputeGranularity | None = None
    recompute_method: RecomputeMethod | None = None
    recompute_num_layers: int | None = None
    # Norm and dropout regions sharded along the sequence over the TP group (needs s % tp == 0).
    sequence_parallel: bool = False
    fused_kernels: bool = (
        False  # frozen RMSNorm and SwiGLU as torch.compile'd loops (pretrain.models.fused_kernels)
    )
    # The library of the frozen fp32 base GEMMs on the CPU (LoRA's adapted linears, the frozen
    # output layer): "auto" is oneDNN on x86 CPUs not made by Intel, MKL elsewhere (pretrain.models.cpu_gemm).
    cpu_gemm: CpuGemm = "auto"
    params_dtype: DTypeName = "float32"
    # BERT-specific switches (ignored by GPT).
    bidirectional: bool = False
    num_tokentypes: int = 0
    # Original BERT (paper figure 7a): LayerNorm after each residual add, a LayerNorm on the
    # embeddings and no final LayerNorm. False = Megatron's pre-LN arrangement (figure 7b).
    post_layernorm: bool = False
    # Llama-family options (Megatron flag names; defaults keep GPT-2 / BERT unchanged).
    normalization: Normalization = "LayerNorm"
    swiglu: bool = False  # fc1 holds [gate; up] (each TP rank its slice of both), silu(gate) * up
    position_embedding_type: PositionEmbeddingType = "learned_absolute"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  # fraction of each head's channels that is rotated
    rotary_seq_len_interpolation_factor: float | None = None  # linear scaling: positions / factor
    use_rope_scaling: bool = False  # Llama-3.1 frequency scaling with the four values below
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    num_query_groups: int | None = None  # GQA/MQA key-value heads (None: multi-head attention)
    kv_channels: int | None = None  # per-head size (None: hidden_size // num_attention_heads)
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True  # False = Megatron's --disable-bias-linear
    add_qkv_bias: bool = False  # QKV bias even without linear biases (Qwen2)
    qk_layernorm: bool = False  # per-head norm of queries and keys before RoPE (Qwen3)
    # RMSNorm over the whole query projection [nq d] and key projection [g d], not per head (OLMoE)
    qk_layernorm_full_width: bool = False
    squared_relu: bool = False  # relu(x)^2 instead of GeLU (Megatron's --squared-relu; not with swiglu)
    # Mixture of experts (Megatron's --num-experts etc.; None = a dense MLP in every layer).
    num_experts: int | None = None  # routed experts per MoE layer
    moe_router_topk: int = 2  # experts each token is sent to
    moe_ffn_hidden_size: int | None = None  # width of each routed expert (None: ffn_hidden_size)
    moe_layer_freq: int | tuple[int, ...] = 1  # every N-th layer is MoE, or a 0/1 pattern per layer
    moe_router_pre_softmax: bool = False  # softmax over all experts before top-k (no renormalisation)
    moe_router_score_function: RouterScore = "softmax"
    moe_router_topk_scaling_factor: float | None = None  # multiplies the top-k probabilities
    moe_shared_expert_intermediate_size: int | None = None  # width of the always-on shared expert
    moe_shared_expert_gate: bool = False  # sigmoid(x . gate) scales the shared expert (Qwen2-MoE)
    moe_router_load_balancing_type: LoadBalancing = "aux_loss"  # training only
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss weight (training only; 0: off)
    moe_z_loss_coeff: float | None = None  # router z-loss weight (training only)
    moe_expert_capacity_factor: float | None = None  # None: dropless routing
    moe_token_drop_policy: DropPolicy = "probs"  # which routed slots past capacity are dropped

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "vocab_size",
            "max_position_embeddings",
        ):
            if int(getattr(self, name)) <= 0:
                raise UserError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise UserError(
                f"model config: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"model config: {name} must be in [0, 1), got {getattr(self, name)}")
        if self.gelu not in ("tanh", "erf"):
            raise UserError(f"model config: gelu must be 'tanh' or 'erf', got {self.gelu!r}")
        if self.params_dtype not in ("float32", "bfloat16", "float16"):
            raise UserError(f"model config: unknown params_dtype {self.params_dtype!r}")
        if self.cpu_gemm not in get_args(CpuGemm):
            raise UserError(
                f"--cpu-gemm must be one of {', '.join(get_args(CpuGemm))}, got {self.cpu_gemm!r}"
            )
        self._check_llama_options()
        self._check_recompute()
        if self.squared_relu and self.swiglu:
            raise UserError("model config: squared_relu and swiglu exclude each other")
        if self.qk_layernorm_full_width and (self.qk_layernorm or self.normalization != "RMSNorm"):
            raise UserError(
                "model config: qk_layernorm_full_width (OLMoE's full-width RMSNorm) excludes qk_layernorm "
                "(per head) and needs normalization RMSNorm"
            )
        if self.num_experts is not None:
            self._check_moe_options()

    def _check_moe_options(self) -> None:
        if isinstance(self.moe_layer_freq, list):  # from JSON metadata: a hashable tuple
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        experts, topk = int(self.num_experts or 0), self.moe_router_topk
        if experts < 1:
            raise UserError(f"model config: num_experts must be positive, got {self.num_experts}")
        if not 1 <= topk <= experts:
            raise UserError(f"model config: moe_router_topk {topk} must be in [1, num_experts {experts}]")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise UserError(
                "model config: moe_router_score_function must be softmax or sigmoid, "
                f"got {self.moe_router_score_function!r}"
            )
        if self.add_bias_linear:
            raise UserError(
                "model config: mixture-of-experts layers need add_bias_linear=False (--disable-bias-linear)"
            )
        if self.post_layernorm or self.bidirectional:
            raise UserError("model config: mixture-of-experts layers are supported in decoders only")
        freq = self.moe_layer_freq
        if isinstance(freq, int) and freq < 1:
            raise UserError(f"model config: moe_layer_freq must be positive, got {freq}")
        if not isinstance(freq, int) and (len(freq) != self.num_layers or set(freq) - {0, 1}):
            raise UserError(
                f"model config: moe_layer_freq pattern {list(freq)} must hold one 0/1 per layer ({self.num_layers})"
            )
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            value = getattr(self, name)
            if value is not None and int(value) <= 0:
                raise UserError(f"model config: {name} must be positive, got {value}")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise UserError("model config: moe_shared_expert_gate needs moe_shared_expert_intermediate_size")
        choices = {
            "moe_router_load_balancing_type": ("aux_loss", "none"),
            "moe_token_drop_policy": ("probs", "position"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise UserError(
                    f"model config: {name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        factor = self.moe_expert_capacity_factor
        if factor is not None and factor <= 0:
            raise UserError(f"model config: moe_expert_capacity_factor must be positive, got {factor}")

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (0-based) has a mixture-of-experts MLP (Megatron's
        ``--moe-layer-freq``: every N-th layer starting with the first, or a 0/1 pattern)."""
        if self.num_experts is None:
            return False
        freq = self.moe_layer_freq
        return layer_number % freq == 0 if isinstance(freq, int) else bool(freq[layer_number])

    @property
    def moe_ffn_size(self) -> int:
        """Width of each routed expert: ``moe_ffn_hidden_size``, else the dense MLP width."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_size

    def without_memory_options(self) -> ModelConfig:
        """This config with sequence parallelism, the recompute granularity and fused kernels off:
        how a run keeps its activations and which kernels it runs are its own choice, not the
        model's, so checkpoints record the model without them (evaluation, generation and
        finetuning of the checkpoint start from plain TP and eager kernels)."""
        return dataclasses.replace(
            self, sequence_parallel=False, recompute_granularity=None, recompute_method=None,
            recompute_num_layers=None, fused_kernels=False, cpu_gemm="auto",
        )  # fmt: skip

    def _check_recompute(self) -> None:
        """Megatron's rules for the recompute flags (``arguments.py``), worded with the flags."""
        granularity, method, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if granularity not in (None, "full", "selective"):
            raise UserError(f"--recompute-granularity must be full or selective, got {granularity!r}")
        if method not in (None, "uniform", "block"):
            raise UserError(f"--recompute-method must be uniform or block, got {method!r}")
        if granularity is not None and self.recompute_activations:
            raise UserError("--recompute-activations and --recompute-granularity exclude each other")
        if granularity == "full" and (method is None or n is None):
            raise UserError(
                "--recompute-granularity full needs --recompute-method and --recompute-num-layers"
            )
        if granularity != "full" and (method is not None or n is not None):
            raise UserError("--recompute-method and --recompute-num-layers need --recompute-granularity full")
        if n is not None and n <= 0:
            raise UserError(f"--recompute-num-layers must be positive, got {n}")

    def _check_llama_options(self) -> None:
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise UserError(
                f"model config: normalization must be LayerNorm or RMSNorm, got {self.normalization!r}"
            )
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise UserError(
                "model config: position_embedding_type must be learned_absolute or rope, "
                f"got {self.position_embedding_type!r}"
            )
        if self.normalization == "RMSNorm" and self.post_layernorm:
            raise UserError("model config: RMSNorm is supported with pre-LN models only (not post_layernorm)")
        for name in ("kv_channels", "num_query_groups", "ffn_hidden_size"):
            value = getattr(self, name)
            if value is not None and int(value) <= 0:
                raise UserError(f"model config: {name} must be positive, got {value}")
        groups = self.num_query_groups
        if groups is not None and self.num_attention_heads % groups:
            raise UserError(
                f"model config: num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_query_groups {groups}"
            )
        if not 0.0 < self.rotary_percent <= 1.0:
            raise UserError(f"model config: rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.rotary_base <= 0:
            raise UserError(f"model config: rotary_base must be positive, got {self.rotary_base}")
        if self.position_embedding_type == "rope" and self.rotary_dim % 2:
            raise UserError(
                f"model config: rotary dimension {self.rotary_dim} (kv_channels x rotary_percent) is odd"
            )
        if self.use_rope_scaling and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise UserError("model config: rope_high_freq_factor must exceed rope_low_freq_factor")
        factor = self.rotary_seq_len_interpolation_factor
        if factor is not None and factor <= 0:
            raise UserError(
                f"model config: rotary_seq_len_interpolation_factor must be positive, got {factor}"
            )

    @property
    def ffn_size(self) -> int:
        """``ffn_hidden_size``, else 4h, or Megatron's SwiGLU default ``int(8h/3 / 64) * 64``."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        """Channels per attention head (Megatron's ``kv_channels``)."""
        return (
            self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads
        )

    @property
    def query_groups(self) -> int:
        """Key-value heads: ``num_query_groups``, or one per attention head (multi-head attention)."""
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (``kv_channels * rotary_percent``)."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise :class:`UserError` if this model cannot be split ``tp`` ways.

        Key-value groups split over TP ranks (``num_query_groups % tp == 0``) or, when ``tp`` is a
        multiple of them, are replicated on ``tp / num_query_groups`` ranks each (evaluation and
        resharding only; see :func:`check_training_tensor_parallel`).
        """
        if self.num_attention_heads % tp:
            raise UserError(f"num_attention_heads {self.num_attention_heads} is not divisible by --tp {tp}")
        if self.ffn_size % tp:
            raise UserError(f"ffn_hidden_size {self.ffn_size} is not divisible by --tp {tp}")
        if self.num_experts is not None:
            widths = {
                "moe_ffn_hidden_size": self.moe_ffn_size,
                "moe_shared_expert_intermediate_size": self.moe_shared_expert_intermediate_size,
            }
            for name, width in widths.items():
                if width is not None and width % tp:
                    raise UserError(f"{name} {width} is not divisible by --tp {tp}")
        groups = self.query_groups
        if self.qk_layernorm_full_width and groups % tp:
            raise UserError(
                f"num_query_groups {groups} is not divisible by --tp {tp}: the full-width key norm "
                "(qk_layernorm_full_width) needs each key-value group on one rank"
            )
        if groups % tp and tp % groups:
            raise UserError(
                f"num_query_groups {groups} and --tp {tp}: one must divide the other "
                "(groups split over ranks, or each group replicated on tp/groups ranks)"
            )

    def check_training_tensor_parallel(self, tp: int) -> None:
        """Training needs each key-value group on one rank only (as Megatron): ``tp <= groups``.

        With replicated key-value heads (``tp > num_query_groups``) every replica would receive only
        the gradient of its own query heads and the copies would drift apart.
        """
        self.check_tensor_parallel(tp)
        if tp > self.query_groups:
            raise UserError(
                f"--tp {tp} exceeds num_query_groups {self.query_groups}: training needs every key-value "
                "group on one rank (replicated key-value heads are for evaluation and resharding only)"
            )


@dataclass(frozen=True, kw_only=True)
class DTypeFlags:
    """The dtype of a model's weights: ``--dtype`` (evaluation) or Megatron's ``--bf16``/``--fp16``."""

    dtype: Literal["fp32", "bf16", "fp16"] = field(default="fp32", metadata=flag_meta("model weights' dtype"))
    bf16: bool = field(
        default=False, metadata=flag_meta("bfloat16 weights and compute (fp32 master weights)")
    )
    fp16: bool = field(default=False, metadata=flag_meta("float16 weights and compute with loss scaling"))

    def dtype_name(self) -> DTypeName:
        """The torch dtype's name: ``--bf16``/``--fp16`` where given, else ``--dtype``."""
        if self.bf16 and self.fp16:
            raise UserError("--bf16 and --fp16 are mutually exclusive")
        if self.bf16 or self.fp16:
            return "bfloat16" if self.bf16 else "float16"
        names: dict[str, DTypeName] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
        return names[self.dtype]
