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


def vocab_range(padded_vocab: int, *, tp_rank: int, tp: int) -> tuple[int, int]:
    """The ``[start, end)`` rows of the padded vocabulary held by ``tp_rank``."""
    per_rank = padded_vocab // tp
    return tp_rank * per_rank, (tp_rank + 1) * per_rank
