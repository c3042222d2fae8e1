"""The index of kept documents: an LSH (``datasketch.MinHashLSH``) over their MinHash signatures.

Memory: each kept document costs its signature (``4 * num_perm`` bytes, 512 B by default, in one
growing numpy array), its line number and id, and one entry in each of the ``b`` LSH band tables
(``b = 20`` for the defaults; datasketch keeps a Python ``set`` per bucket, ~300 B per entry).
Measured: about 7.5 KB per kept document with the defaults, i.e. ~7.5 GB per million kept
documents; removed documents and document text cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from datasketch import LeanMinHash, MinHashLSH

from tools.hygiene.shingles import SCHEME


@dataclass(frozen=True, kw_only=True)
class Match:
    """The kept document a new document duplicates, and their estimated Jaccard similarity."""

    line: int
    doc_id: Any
    jaccard: float


class KeptIndex:
    """Signatures of kept documents, queried through LSH and confirmed by estimated Jaccard.

    A document is a duplicate when an LSH candidate's estimated Jaccard similarity (the share of
    equal MinHash values) is ``>= threshold``; the best match (highest estimate, then earliest
    line) is reported. LSH bands favour recall (``weights``: false positives only cost one
    signature comparison, false negatives keep a duplicate).
    """

    def __init__(
        self, *, threshold: float, num_perm: int, seed: int, weights: tuple[float, float] = (0.1, 0.9)
    ) -> None:
        self.threshold = threshold
        self._seed = seed
        self._lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=weights)
        self._sigs = np.empty((1024, num_perm), dtype=np.uint32)
        self._lines: list[int] = []
        self._ids: list[Any] = []

    def __len__(self) -> int:
        return len(self._lines)

    @property
    def bands(self) -> tuple[int, int]:
        """The LSH ``(bands, rows per band)`` chosen for the threshold."""
        return self._lsh.b, self._lsh.r

    def _lean(self, sig: np.ndarray) -> LeanMinHash:
        return LeanMinHash(seed=self._seed, hashvalues=sig, scheme=SCHEME)

    def match(self, sig: np.ndarray) -> Match | None:
        """The best kept document with estimated Jaccard ``>= threshold``, or None."""
        candidates = self._lsh.query(self._lean(sig))
        if not candidates:
            return None
        keys = np.sort(np.asarray(candidates, dtype=np.int64))
        estimates = (self._sigs[keys] == sig).mean(axis=1)
        best = int(np.argmax(estimates))  # first maximum = earliest kept line among ties
        if estimates[best] < self.threshold:
            return None
        key = int(keys[best])
        return Match(line=self._lines[key], doc_id=self._ids[key], jaccard=float(estimates[best]))

    def add(self, sig: np.ndarray, *, line: int, doc_id: Any) -> None:
        """Index a kept document."""
        key = len(self._lines)
        if key == len(self._sigs):
            self._sigs = np.concatenate([self._sigs, np.empty_like(self._sigs)])
        self._sigs[key] = sig
        self._lines.append(line)
        self._ids.append(doc_id)
        self._lsh.insert(key, self._lean(sig), check_duplication=False)
