"""The ``args`` entry of a checkpoint: plain data (no pickled Namespace), Megatron-compatible names."""

from __future__ import annotations

import dataclasses
from typing import Any

from pretrain.config import ModelConfig, ParallelConfig
from pretrain.tensor_parallel.vocab import padded_vocab_size
from pretrain.utils.errors import UserError


def checkpoint_args(
    model: ModelConfig, parallel: ParallelConfig, *, model_type: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Plain-data args: Megatron's flat names (read by upstream tools) plus our full configs."""
    return {
        "model_type": model_type,
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "ffn_hidden_size": model.ffn_size,
        "num_attention_heads": model.num_attention_heads,
        "max_position_embeddings": model.max_position_embeddings,
        "vocab_size": model.vocab_size,
        "padded_vocab_size": padded_vocab_size(
            model.vocab_size, tp=parallel.tp, divisible_by=model.make_vocab_size_divisible_by
        ),
        "make_vocab_size_divisible_by": model.make_vocab_size_divisible_by,
        "layernorm_epsilon": model.layernorm_epsilon,
        "tensor_model_parallel_size": parallel.tp,
        "pipeline_model_parallel_size": parallel.pp,
        "virtual_pipeline_model_parallel_size": parallel.vp if parallel.vp > 1 else None,
        "params_dtype": model.params_dtype,
        "mlm_toolkit": {
            "model": dataclasses.asdict(model),
            "parallel": dataclasses.asdict(parallel),
            **(extra or {}),
        },
    }


def model_config_from_args(args: dict[str, Any], *, source: str = "checkpoint") -> ModelConfig:
    """Rebuild the ``ModelConfig`` saved by :func:`checkpoint_args` (our checkpoints)."""
    ours = args.get("mlm_toolkit", {}).get("model") if isinstance(args, dict) else None
    if not isinstance(ours, dict):
        raise UserError(f"{source}: args has no mlm_toolkit.model entry (not written by mlm-toolkit)")
    return ModelConfig(**ours)


def parallel_config_from_args(args: dict[str, Any]) -> ParallelConfig:
    ours = args.get("mlm_toolkit", {}).get("parallel")
    if isinstance(ours, dict):
        return ParallelConfig(**ours)
    vp = args.get("virtual_pipeline_model_parallel_size") or 1
    return ParallelConfig(
        tp=int(args.get("tensor_model_parallel_size", 1)),
        pp=int(args.get("pipeline_model_parallel_size", 1)),
        vp=int(vp),
    )
