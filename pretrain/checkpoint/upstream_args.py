"""Model kind and ``ModelConfig`` of a checkpoint from its ``args`` (ours or upstream) and shapes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pretrain.config import ModelConfig
from pretrain.utils.errors import UserError

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Upstream features our models do not implement: (arg, value that is unsupported, description).
_UNSUPPORTED = [
    ("apply_residual_connection_post_layernorm", True, "residual from the LayerNorm output"),
    ("untie_embeddings_and_output_weights", True, "an untied output layer"),
    ("swiglu", True, "SwiGLU"),
    ("group_query_attention", True, "grouped-query attention"),
    ("add_bias_linear", False, "linear layers without biases"),
]


def check_supported(args: Mapping[str, Any], source: str) -> None:
    """Refuse upstream checkpoints of architectures our GPT/BERT cannot represent."""
    for key, bad, what in _UNSUPPORTED:
        if key in args and args[key] == bad:
            raise UserError(f"{source}: args.{key}={bad}: {what} is not supported by mlm-toolkit models")
    if str(args.get("normalization", "LayerNorm")) != "LayerNorm":
        raise UserError(
            f"{source}: args.normalization={args['normalization']} is not supported (LayerNorm only)"
        )
    pos = str(args.get("position_embedding_type", "learned_absolute"))
    if pos != "learned_absolute":
        raise UserError(f"{source}: args.position_embedding_type={pos} is not supported (learned only)")


def model_kind(args: Mapping[str, Any], local_names: set[str]) -> str:
    """``gpt`` or ``bert``: our args name it; upstream BERT has heads/token types GPT lacks."""
    ours = args.get("model_type")
    if isinstance(ours, str) and ours in ("gpt", "bert"):
        return ours
    bert_markers = ("lm_head.", "binary_head.", "language_model.embedding.tokentype_embeddings.")
    return "bert" if any(n.startswith(bert_markers) for n in local_names) else "gpt"


def true_vocab_size(
    args: Mapping[str, Any], padded_rows: int, *, override: int | None, tokenizer_dir: str | Path | None
) -> tuple[int, str]:
    """The tokenizer's vocabulary size and where it came from."""
    if override is not None:
        found, how = int(override), "--vocab-size"
    elif tokenizer_dir is not None:
        from pretrain.checkpoint.hf_io import load_hf_tokenizer

        found, how = len(load_hf_tokenizer(Path(tokenizer_dir))), f"tokenizer {tokenizer_dir}"
    elif isinstance(args.get("vocab_size"), int):
        found, how = int(args["vocab_size"]), "args.vocab_size"
    else:
        return padded_rows, "padded size (pass --vocab-size or --tokenizer-dir to trim)"
    if not 0 < found <= padded_rows:
        raise UserError(f"vocab size {found} (from {how}) does not fit the checkpoint's {padded_rows} rows")
    return found, how


def _dtype_name(args: Mapping[str, Any], sample: torch.Tensor) -> str:
    dtype = args.get("params_dtype")
    if isinstance(dtype, torch.dtype) and dtype in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype]
    if isinstance(dtype, str) and dtype in _DTYPE_NAMES.values():
        return dtype
    if args.get("bf16"):
        return "bfloat16"
    if args.get("fp16"):
        return "float16"
    return _DTYPE_NAMES.get(sample.dtype, "float32")


def upstream_model_config(
    args: Mapping[str, Any],
    shapes: Mapping[str, torch.Tensor],
    *,
    kind: str,
    tp: int,
    vocab_size: int,
    num_layers: int,
    source: str,
) -> ModelConfig:
    """``ModelConfig`` of an upstream checkpoint from its args, falling back to tensor shapes.

    ``shapes`` maps our local names of the first layer / embeddings (TP rank 0) to tensors.
    """
    check_supported(args, source)
    lm = "language_model."
    pos = shapes.get(lm + "embedding.position_embeddings.weight")
    fc1 = shapes.get(lm + "encoder.layers.0.mlp.dense_h_to_4h.weight")
    hidden = args.get("hidden_size") or (pos.shape[1] if pos is not None else None)
    heads = args.get("num_attention_heads")
    if not hidden or not heads:
        raise UserError(f"{source}: args lack hidden_size/num_attention_heads, needed to read the QKV layout")
    ffn = args.get("ffn_hidden_size") or (fc1.shape[0] * tp if fc1 is not None else 4 * hidden)
    max_pos = args.get("max_position_embeddings") or (pos.shape[0] if pos is not None else None)
    if not max_pos:
        raise UserError(f"{source}: cannot tell max_position_embeddings (no args, no position embeddings)")
    tokentypes = shapes.get(lm + "embedding.tokentype_embeddings.weight")
    eps = args.get("layernorm_epsilon", args.get("norm_epsilon", 1e-5))
    sample = next(iter(shapes.values()))
    return ModelConfig(
        num_layers=num_layers,
        hidden_size=int(hidden),
        num_attention_heads=int(heads),
        vocab_size=vocab_size,
        max_position_embeddings=int(max_pos),
        ffn_hidden_size=int(ffn),
        make_vocab_size_divisible_by=int(args.get("make_vocab_size_divisible_by") or 128),
        hidden_dropout=float(args.get("hidden_dropout", 0.1)),
        attention_dropout=float(args.get("attention_dropout", 0.1)),
        layernorm_epsilon=float(eps),
        init_method_std=float(args.get("init_method_std", 0.02)),
        gelu="tanh" if args.get("openai_gelu") else "erf",  # upstream default: F.gelu (erf)
        params_dtype=_dtype_name(args, sample),  # type: ignore[arg-type]
        bidirectional=kind == "bert",
        num_tokentypes=0 if tokentypes is None else int(tokentypes.shape[0]),
        post_layernorm=False,
    )


def our_model_config(args: Mapping[str, Any], *, vocab_size: int, source: str) -> ModelConfig:
    """The ``ModelConfig`` our checkpoints store, with the vocabulary possibly overridden."""
    from pretrain.checkpoint.args import model_config_from_args

    cfg = model_config_from_args(dict(args), source=source)
    return dataclasses.replace(cfg, vocab_size=vocab_size)
