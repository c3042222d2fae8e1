"""Masked-LM predictions for BERT: whole-word n-gram masking with 80/10/10 replacement.

Megatron's ``create_masked_lm_predictions`` (its defaults: whole-word masking, n-grams up to 3,
no geometric span lengths, ``masking_style="bert"``), on token ids:

1. **Words.** A WordPiece token whose text starts with ``##`` continues the previous word;
   ``[CLS]`` and ``[SEP]`` are never candidates. Unlike Megatron, a ``##`` piece right after
   ``[CLS]``/``[SEP]`` (a segment truncated mid-word) starts a new word instead of joining the
   last word of the previous segment, so a masked "word" never spans the separator.
2. **Budget.** ``num_to_predict = min(max_predictions, max(1, round(len(tokens) * prob)))``
   (``len`` counts [CLS]/[SEP], as Megatron).
3. **N-grams.** The word start positions are shuffled. For each start ``i``, ``n`` is drawn from
   ``1..N`` (``N = min(max_ngrams, words left from i)``) with probability proportional to ``1/n``
   (6/11, 3/11, 2/11 for N = 3: shorter spans favoured; this is Megatron's non-geometric rule).
   If words ``i .. i+n-1`` would overshoot the budget, ``n`` is reduced; if even one word
   overshoots, or any of its tokens is already masked, the start is skipped.
4. **Replacement,** drawn independently per masked token: 80% ``[MASK]``, 10% the original
   token, 10% a uniformly random id of the vocabulary (specials included, as Megatron).

Randomness comes only from the ``numpy.random.RandomState`` passed in, so a sample is a pure
function of its seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pretrain.tokenizer.base import Tokenizer
from pretrain.utils.errors import UserError


@dataclass(frozen=True, kw_only=True, eq=False)
class BertVocab:
    """What masking needs from a WordPiece vocabulary.

    ``continuation``: bool ``[size]``, True for ``##`` pieces (word continuations).
    """

    cls: int
    sep: int
    pad: int
    mask: int
    size: int
    continuation: np.ndarray

    def __post_init__(self) -> None:
        if self.continuation.shape != (self.size,):
            raise UserError(f"BERT vocab: continuation flags {self.continuation.shape} != ({self.size},)")
        for name in ("cls", "sep", "pad", "mask"):
            if not 0 <= getattr(self, name) < self.size:
                raise UserError(f"BERT vocab: [{name.upper()}] id {getattr(self, name)} out of range")

    @classmethod
    def from_tokens(cls, tokens: Sequence[str]) -> BertVocab:
        """From the token strings in id order (``vocab.txt`` lines)."""
        index = {t: i for i, t in enumerate(tokens)}
        missing = [t for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]") if t not in index]
        if missing:
            raise UserError(f"BERT vocab lacks special tokens {', '.join(missing)}")
        flags = np.array([t.startswith("##") for t in tokens], dtype=bool)
        return cls(
            cls=index["[CLS]"], sep=index["[SEP]"], pad=index["[PAD]"], mask=index["[MASK]"],
            size=len(tokens), continuation=flags,
        )  # fmt: skip

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> BertVocab:
        """From a WordPiece :class:`~pretrain.tokenizer.base.Tokenizer` (its special ids and
        ``id_to_token`` for the ``##`` flags)."""
        ids = {n: getattr(tokenizer, n) for n in ("cls", "sep", "pad", "mask")}
        missing = [f"[{n.upper()}]" for n, v in ids.items() if v is None]
        if missing:
            raise UserError(
                f"tokenizer {tokenizer!r} has no {', '.join(missing)}: BERT needs a WordPiece vocab"
            )
        size = int(tokenizer.vocab_size)
        flags = np.array([tokenizer.id_to_token(i).startswith("##") for i in range(size)], dtype=bool)
        return cls(**{n: int(v) for n, v in ids.items()}, size=size, continuation=flags)


def word_candidates(tokens: Sequence[int], vocab: BertVocab, *, whole_word: bool = True) -> list[list[int]]:
    """Positions of ``tokens`` grouped into words (``##`` pieces join the previous word);
    [CLS]/[SEP] positions are excluded. Without ``whole_word`` every token is its own group."""
    words: list[list[int]] = []
    after_special = True
    for i, tok in enumerate(tokens):
        if tok == vocab.cls or tok == vocab.sep:
            after_special = True
            continue
        if whole_word and not after_special and vocab.continuation[tok]:
            words[-1].append(i)
        else:
            words.append([i])
        after_special = False
    return words


def _ngram_length(available: int, max_ngrams: int, rng: np.random.RandomState) -> int:
    ns = np.arange(1, min(max_ngrams, available) + 1)
    p = 1.0 / ns
    return int(rng.choice(ns, p=p / p.sum()))


def _replacement(token: int, vocab: BertVocab, rng: np.random.RandomState) -> int:
    if rng.random_sample() < 0.8:
        return vocab.mask
    if rng.random_sample() < 0.5:
        return token
    return int(rng.randint(0, vocab.size))


def create_masked_lm_predictions(
    tokens: Sequence[int],
    vocab: BertVocab,
    *,
    masked_lm_prob: float,
    max_predictions: int,
    rng: np.random.RandomState,
    max_ngrams: int = 3,
    whole_word: bool = True,
) -> tuple[list[int], list[int], list[int]]:
    """Returns ``(output tokens, masked positions (sorted), original ids at those positions)``."""
    output = list(tokens)
    if masked_lm_prob <= 0:
        return output, [], []
    words = word_candidates(tokens, vocab, whole_word=whole_word)
    budget = min(int(max_predictions), max(1, int(round(len(tokens) * masked_lm_prob))))
    starts = np.arange(len(words))
    rng.shuffle(starts)
    covered: set[int] = set()
    for start in starts:
        if len(covered) >= budget:
            break
        n = _ngram_length(len(words) - int(start), max_ngrams, rng)
        span = [i for w in words[start : start + n] for i in w]
        while len(covered) + len(span) > budget and n > 1:  # try shorter n-grams first
            n -= 1
            span = [i for w in words[start : start + n] for i in w]
        if len(covered) + len(span) > budget or any(i in covered for i in span):
            continue
        for i in span:
            covered.add(i)
            output[i] = _replacement(int(tokens[i]), vocab, rng)
    positions = sorted(covered)
    return output, positions, [int(tokens[i]) for i in positions]
