"""Model and parallelism configuration: frozen, keyword-only dataclasses validated on creation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pretrain.utils.errors import UserError

GeluKind = Literal["tanh", "erf"]
DTypeName = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A GPT-2 / BERT style transformer (paper section 3, Megatron's legacy model).

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
    recompute_activations: bool = False
    params_dtype: DTypeName = "float32"
    # BERT-specific switches (ignored by GPT).
    bidirectional: bool = False
    num_tokentypes: int = 0
    # Original BERT (paper figure 7a): LayerNorm after each residual add, a LayerNorm on the
    # embeddings and no final LayerNorm. False = Megatron's pre-LN arrangement (figure 7b).
    post_layernorm: bool = False

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
        if self.hidden_size % self.num_attention_heads:
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

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise :class:`UserError` if this model cannot be split ``tp`` ways."""
        if self.num_attention_heads % tp:
            raise UserError(f"num_attention_heads {self.num_attention_heads} is not divisible by --tp {tp}")
        if self.ffn_size % tp:
            raise UserError(f"ffn_hidden_size {self.ffn_size} is not divisible by --tp {tp}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Tensor (t), pipeline (p) and virtual-pipeline (V) sizes; data parallel d = world / (t * p)."""

    tp: int = 1
    pp: int = 1
    vp: int = 1
    # Optional uneven pipeline split: layers on the first / last stage (None = even split).
    num_layers_in_first_stage: int | None = None
    num_layers_in_last_stage: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vp"):
            if int(getattr(self, name)) <= 0:
                raise UserError(f"--{name} must be a positive integer, got {getattr(self, name)}")
        if self.vp > 1 and self.pp < 2:
            raise UserError(f"--vp {self.vp} needs --pp >= 2 (virtual stages interleave real ones)")
