"""Vocabulary padding and per-rank vocabulary ranges."""

from __future__ import annotations

from pretrain.utils.errors import UserError


def padded_vocab_size(vocab_size: int, *, tp: int, divisible_by: int = 128) -> int:
    """Pad ``vocab_size`` up to a multiple of ``divisible_by * tp`` (Megatron's rule).

    GPT-2's 50257 becomes 50304 / 50432 / 50688 / 51200 for tp = 1 / 2 / 4 / 8.
    """
    if vocab_size <= 0 or tp <= 0 or divisible_by <= 0:
        raise UserError(
            f"vocab padding needs positive sizes (vocab {vocab_size}, tp {tp}, "
            f"make-vocab-size-divisible-by {divisible_by})"
        )
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


# The rule of :func:`rows_fit_tokenizer`: Hugging Face's own padding leaves at most 1/32 of the rows
# unused (Qwen2: 151646 tokens in 151936 rows, 0.2%; Phi-2 and CodeGen: 50295 in 51200, 1.8%;
# DeepSeek-V2: 100015 in 102400, 2.3%); Megatron's padding is a multiple of divisible_by x TP with
# TP at most MAX_PADDING_TP, and fewer padding rows than tokens.
HF_PADDING_SHARE = 32
MAX_PADDING_TP = 64


def rows_fit_tokenizer(tokens: int, rows: int, *, divisible_by: int = 128) -> bool:
    """Whether a model of ``rows`` vocabulary rows can have been made for a tokenizer of ``tokens``.

    True when ``tokens <= rows`` and the ``rows - tokens`` unused rows are padding: none; at most
    ``rows / 32`` (Hugging Face models pad their embeddings a little: Qwen2, Phi-2); or Megatron's
    padding (:func:`padded_vocab_size`) of ``tokens`` for ``divisible_by`` (or the default 128) and a
    TP of at most 64, with fewer padding rows than tokens. A 1-token tokenizer for 1024 rows is not.
    """
    if not 0 < tokens <= rows:
        return False
    unused = rows - tokens
    if unused * HF_PADDING_SHARE <= rows:
        return True
    if unused >= tokens:
        return False
    return any(
        padded_vocab_size(tokens, tp=tp, divisible_by=d) == rows
        for d in {divisible_by, 128}
        if d > 0
        for tp in range(1, MAX_PADDING_TP + 1)
    )


def vocab_range(padded_vocab: int, *, tp_rank: int, tp: int) -> tuple[int, int]:
    """The ``[start, end)`` rows of the padded vocabulary held by ``tp_rank``."""
    per_rank = padded_vocab // tp
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def padding_tp(
    vocab_size: int, padded: int, *, divisible_by: int, saved_tp: int, num_heads: int | None
) -> int | None:
    """The tensor-parallel size whose Megatron padding of ``vocab_size`` gives ``padded`` rows.

    ``saved_tp`` (the saving run's ``tensor_model_parallel_size``) is tried first. Megatron's
    checkpoint converter keeps the table of an earlier run when resharding without
    ``--true-vocab-size``, so any TP that divides ``num_heads`` (Megatron requires it) also
    explains the rows. ``None``: no TP Megatron could have run with pads ``vocab_size`` so.
    """
    if vocab_size <= 0 or divisible_by <= 0 or padded <= 0:
        return None
    candidates = [saved_tp] if saved_tp > 0 else []
    if num_heads:
        candidates += [t for t in range(1, num_heads + 1) if num_heads % t == 0]
    for tp in candidates:
        if padded_vocab_size(vocab_size, tp=tp, divisible_by=divisible_by) == padded:
            return tp
    return None
