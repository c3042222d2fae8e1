"""Model kind and ``ModelConfig`` of a checkpoint from its ``args`` (ours or upstream) and shapes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pretrain.checkpoint.upstream.args_semantics import check_bert_gelu
from pretrain.config import ModelConfig
from pretrain.model_option_codecs import Args
from pretrain.model_options import config_kwargs_from_args, need_int
from pretrain.models.kinds import is_kind, kind_of, kind_of_names
from pretrain.utils.errors import UserError

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def model_kind(args: Args, local_names: set[str]) -> str:
    """The recorded kind: our args name it; else the tensors tell (upstream BERT has heads and
    token types GPT lacks, see :func:`pretrain.models.kinds.kind_of_names`)."""
    ours = args.get("model_type")
    return ours if isinstance(ours, str) and is_kind(ours) else kind_of_names(local_names).name


@dataclass(frozen=True, kw_only=True)
class VocabOptions:
    """How to tell a checkpoint's true vocabulary size besides its ``args``.

    ``size`` is ``--vocab-size``; ``tokenizer_size``/``tokenizer_source`` come from a tokenizer the
    caller loaded (``--tokenizer-dir``); ``root`` is the checkpoint root, against which relative
    tokenizer files in ``args`` (``vocab_file``, ``merge_file``, ``tokenizer_model``) are found.
    """

    size: int | None = None
    tokenizer_size: int | None = None
    tokenizer_source: str = ""
    root: str | None = None


def _args_tokenizer_size(args: Args, root: str | None) -> tuple[int, str] | None:
    """The vocabulary size of the tokenizer upstream ``args`` name, when its files exist."""
    kind = args.get("tokenizer_type")
    if not isinstance(kind, str):
        return None
    from pretrain.tokenizer.loader import tokenizer_from_args

    tok = tokenizer_from_args(args, root=root)
    return None if tok is None else (tok.vocab_size, f"args.tokenizer_type {kind}")


def true_vocab_size(
    args: Args, padded_rows: int, *, tp: int, vocab: VocabOptions, source: str
) -> tuple[int, str]:
    """The tokenizer's vocabulary size and where it came from; ``"padded ..."`` when unknown.

    A size given by flag or tokenizer must fit the rows, agree with a size the checkpoint records
    (``args.vocab_size``) and pad to ``args.padded_vocab_size`` under Megatron's rule; otherwise
    :class:`UserError` naming both. ``tp`` is the stored layout's TP (1 for ``torch_dist``), used
    only when ``args`` lack ``tensor_model_parallel_size``.
    """
    given = args.get("vocab_size")
    recorded = given if isinstance(given, int) else None
    if vocab.size is not None:
        found, how = int(vocab.size), "--vocab-size"
    elif vocab.tokenizer_size is not None:
        found, how = int(vocab.tokenizer_size), vocab.tokenizer_source or "the tokenizer"
    elif recorded is not None:
        return _fits(recorded, "args.vocab_size", padded_rows, source)
    else:
        from_args = _args_tokenizer_size(args, vocab.root)
        if from_args is None:
            return (
                padded_rows,
                "padded size: the true vocabulary is unknown (pass --vocab-size or --tokenizer-dir)",
            )
        found, how = from_args
    if recorded is not None and found != recorded:
        raise UserError(
            f"{source}: {how} gives a vocabulary of {found} tokens but the checkpoint records "
            f"{recorded} (args.vocab_size); use the checkpoint's tokenizer"
        )
    if recorded is None and isinstance(args.get("padded_vocab_size"), int) and found > 0:
        _check_padding(args, found, how, tp=tp, source=source)
    return _fits(found, how, padded_rows, source)


def _check_padding(args: Args, found: int, how: str, *, tp: int, source: str) -> None:
    """``args.padded_vocab_size`` must be Megatron's padding of ``found`` tokens.

    Megatron pads to a multiple of ``make_vocab_size_divisible_by`` times the SAVING run's
    ``args.tensor_model_parallel_size`` (``tp``, the stored layout's, only when args lack it: a
    ``torch_dist`` file has no layout TP); a table kept through a reshard keeps an earlier run's.
    """
    from pretrain.tensor_parallel.vocab import padded_vocab_size, padding_tp

    divisible = (
        need_int(args, "make_vocab_size_divisible_by", source)
        if args.get("make_vocab_size_divisible_by")
        else 128
    )
    saved = args.get("tensor_model_parallel_size")
    saved_tp = int(saved) if isinstance(saved, int) and saved > 0 else tp
    heads = args.get("num_attention_heads")
    padded = need_int(args, "padded_vocab_size", source)
    num_heads = int(heads) if isinstance(heads, int) and heads > 0 else None
    if found == padded:  # no padding (megatron-core >= 0.18: --padded-vocab-size / --no-pad-vocab-size)
        return
    if padding_tp(found, padded, divisible_by=divisible, saved_tp=saved_tp, num_heads=num_heads) is None:
        at_saved = padded_vocab_size(found, tp=saved_tp, divisible_by=divisible)
        others = f" nor at any TP dividing num_attention_heads {num_heads}" if num_heads else ""
        raise UserError(
            f"{source}: {how} gives {found} tokens, which pads to {at_saved} rows at the saving run's "
            f"tensor_model_parallel_size {saved_tp} (make_vocab_size_divisible_by {divisible}){others}, "
            f"but the checkpoint has args.padded_vocab_size {padded}; use the checkpoint's tokenizer"
        )


def _fits(found: int, how: str, padded_rows: int, source: str) -> tuple[int, str]:
    if not 0 < found <= padded_rows:
        raise UserError(
            f"{source}: vocab size {found} (from {how}) does not fit the checkpoint's {padded_rows} rows"
        )
    return found, how


def _dtype_name(args: Args, sample: torch.Tensor) -> str:
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
    args: Args,
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
    options = config_kwargs_from_args(args, source=source)
    model_kind = kind_of(kind)
    if model_kind.has_mlm_head:
        check_bert_gelu(args, options["gelu"], source)
    lm = "language_model."
    pos = shapes.get(lm + "embedding.position_embeddings.weight")
    hidden = need_int(args, "hidden_size", source)
    heads = need_int(args, "num_attention_heads", source)
    fc1 = shapes.get(lm + "encoder.layers.0.mlp.dense_h_to_4h.weight")
    ffn = (
        need_int(args, "ffn_hidden_size", source)
        if args.get("ffn_hidden_size") or options["swiglu"]  # a SwiGLU fc1 is two widths: args tell
        else int(fc1.shape[0]) * tp
        if fc1 is not None
        else 4 * hidden
    )
    max_pos = (
        need_int(args, "max_position_embeddings", source)
        if args.get("max_position_embeddings") or pos is None
        else int(pos.shape[0])
    )
    tokentypes = shapes.get(lm + "embedding.tokentype_embeddings.weight")
    if options["num_query_groups"] == heads:
        options["num_query_groups"] = None  # one group per head: multi-head attention
    return ModelConfig(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_pos,
        ffn_hidden_size=ffn,
        params_dtype=_dtype_name(args, next(iter(shapes.values()))),  # type: ignore[arg-type]
        bidirectional=model_kind.bidirectional,
        num_tokentypes=0 if tokentypes is None else int(tokentypes.shape[0]),
        post_layernorm=False,
        **options,  # type: ignore[arg-type]
    )
