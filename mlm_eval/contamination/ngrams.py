"""Word n-gram hashing and the compact eval n-gram set behind ``mlm-eval contamination``.

Normalisation rule (eval and training text alike): ``str.lower()``, then every character that is
not a Unicode letter, digit or whitespace (regex ``[^\\w\\s]|_``: punctuation, symbols, ``_``) is
replaced by a space, then the text is split on whitespace. Replacing (rather than deleting)
punctuation makes WikiText's tokenised forms match raw text: ``nine @-@ inch`` and ``nine-inch``
both become ``nine inch``, ``1 @,@ 000`` and ``1,000`` both ``1 000``.

An n-gram is ``n`` consecutive normalised words of one example or document; n-grams never cross
example or document boundaries. Each n-gram is hashed to 64 bits as ``sum_j v(w_j) * m_j mod
2**64`` with ``v(w)`` the BLAKE2b-64 hash of the word and ``m_j`` fixed random odd multipliers, so
two different n-grams collide with probability about ``2**-64``: over ``1e11`` training n-grams
against ``1e6`` eval n-grams the chance of even one false hit is under 1%.

Memory: only the *eval* side is stored: 16 bytes per eval n-gram position (hash + index into the
unique set), 9 bytes per distinct eval n-gram, a prefilter of 16-32 bytes per distinct eval
n-gram, plus a dict of the eval vocabulary (WikiText-103 test: ~280k n-grams and ~20k words, about
20 MB). Training text is streamed in batches of
``flush_words`` words (about 40 bytes per word while a batch is in flight, ~40 MB by default); a
training word outside the eval vocabulary maps to 0 and can never complete an eval n-gram. Memory
therefore does not grow with the size of the training corpus.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Sequence

import numpy as np

_NON_WORD = re.compile(r"[^\w\s]|_")
_MULTIPLIER_SEED = 0x5EED_8C0A


def normalise_words(text: str) -> list[str]:
    """Apply the normalisation rule of this module and return the words."""
    return _NON_WORD.sub(" ", text.lower()).split()


def word_value(word: str) -> int:
    """The 64-bit value of a word (BLAKE2b, independent of process and insertion order)."""
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest(), "little")


class NgramHasher:
    """Hashes word n-grams over a vocabulary that grows with the eval set and is frozen for training."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        rng = np.random.default_rng(_MULTIPLIER_SEED)
        self._mult = rng.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False) | np.uint64(1)
        self.vocab: dict[str, int] = {}
        self._values: list[int] = [0]  # id 0 = a word outside the eval vocabulary
        self._value_array = np.zeros(1, dtype=np.uint64)

    def add_words(self, words: Sequence[str]) -> np.ndarray:
        """Word values of ``words``, adding unseen words to the vocabulary (eval side)."""
        values = np.empty(len(words), dtype=np.uint64)
        for i, word in enumerate(words):
            wid = self.vocab.get(word)
            if wid is None:
                wid = self.vocab[word] = len(self._values)
                self._values.append(word_value(word))
            values[i] = self._values[wid]
        return values

    def freeze(self) -> None:
        """Fix the vocabulary; afterwards unknown words map to id 0 (value 0)."""
        self._value_array = np.asarray(self._values, dtype=np.uint64)

    def lookup(self, words: Sequence[str]) -> list[int]:
        """Ids of ``words`` in the frozen vocabulary (0 for unknown words; training side)."""
        return list(map(self.vocab.get, words, itertools.repeat(0)))

    def values(self, ids: np.ndarray) -> np.ndarray:
        """Word values of frozen-vocabulary ids."""
        return self._value_array[ids]

    def hashes(self, values: np.ndarray) -> np.ndarray:
        """The hash of every n-gram window of a sequence of word values (empty when shorter than n)."""
        count = len(values) - self.n + 1
        if count <= 0:
            return np.empty(0, dtype=np.uint64)
        acc = np.zeros(count, dtype=np.uint64)
        for j in range(self.n):
            acc += values[j : j + count] * self._mult[j]  # uint64 arithmetic wraps mod 2**64
        return acc


class EvalNgramSet:
    """The eval set's n-gram hashes per example, and which of them the training data contains."""

    def __init__(self, hasher: NgramHasher, texts: Sequence[str]) -> None:
        per_example = [hasher.hashes(hasher.add_words(normalise_words(t))) for t in texts]
        hasher.freeze()
        self.offsets = np.zeros(len(texts) + 1, dtype=np.int64)
        self.offsets[1:] = np.cumsum([len(h) for h in per_example])
        positions = np.concatenate(per_example) if per_example else np.empty(0, dtype=np.uint64)
        self.unique, self._inverse = np.unique(positions, return_inverse=True)
        self.seen = np.zeros(len(self.unique), dtype=bool)
        # A one-hash Bloom-like prefilter (>= 16 slots per eval n-gram, so ~94% of training
        # n-grams that are not eval n-grams are rejected by one gather, before the binary search).
        bits = max(16, int(16 * max(len(self.unique), 1) - 1).bit_length())
        self._shift = np.uint64(64 - bits)
        self._prefilter = np.zeros(1 << bits, dtype=bool)
        self._prefilter[self.unique >> self._shift] = True

    def mark(self, train_hashes: np.ndarray) -> None:
        """Mark every eval n-gram whose hash occurs in ``train_hashes``."""
        if len(self.unique) == 0 or len(train_hashes) == 0:
            return
        train_hashes = train_hashes[self._prefilter[train_hashes >> self._shift]]
        pos = np.searchsorted(self.unique, train_hashes)
        pos[pos == len(self.unique)] = 0
        hit = self.unique[pos] == train_hashes
        self.seen[pos[hit]] = True

    def position_hits(self) -> np.ndarray:
        """For every eval n-gram position (in example order), whether the training data has it."""
        return self.seen[self._inverse]

    def example_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """``(n-grams, contaminated n-grams)`` of each example, counting repeats."""
        hits = np.concatenate([[0], np.cumsum(self.position_hits(), dtype=np.int64)])
        totals = np.diff(self.offsets)
        return totals, hits[self.offsets[1:]] - hits[self.offsets[:-1]]


class TrainScanner:
    """Streams training text through an :class:`EvalNgramSet` in batches of words."""

    def __init__(self, hasher: NgramHasher, eval_set: EvalNgramSet, *, flush_words: int = 1_000_000) -> None:
        self._hasher = hasher
        self._eval = eval_set
        self._flush_words = flush_words
        self._buffer: list[int] = []
        self._doc_words = 0
        self.documents = 0
        self.words = 0
        self.ngrams = 0

    def feed(self, text: str, *, end_of_document: bool) -> None:
        """Add a piece of a training document; n-grams span pieces until ``end_of_document``."""
        ids = self._hasher.lookup(normalise_words(text))
        self._buffer.extend(ids)
        self._doc_words += len(ids)
        if end_of_document:
            self.documents += 1
            self.words += self._doc_words
            self.ngrams += max(0, self._doc_words - self._hasher.n + 1)
            self._doc_words = 0
            # A separator with value 0: eval n-grams never contain it, so a window across two
            # documents matches nothing (up to a 2**-64 collision).
            self._buffer.append(0)
        if len(self._buffer) >= self._flush_words:
            self._flush(keep_tail=True)

    def finish(self) -> None:
        """Scan what is left in the buffer."""
        self._flush(keep_tail=False)

    def _flush(self, *, keep_tail: bool) -> None:
        ids = np.asarray(self._buffer, dtype=np.int64)
        self._eval.mark(self._hasher.hashes(self._hasher.values(ids)))
        # The last n-1 words start the next batch, so windows across the cut are scanned once.
        tail = self._hasher.n - 1
        self._buffer = self._buffer[len(self._buffer) - tail :] if keep_tail and tail else []
