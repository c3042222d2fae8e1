"""Word shingles and MinHash signatures (``datasketch``) for near-duplicate detection.

Normalisation rule (shared by every document): Unicode NFKC, lower case, every character that is
neither a letter/digit nor whitespace (punctuation, symbols, ``_``) becomes a space, then split on
whitespace. Shingles are the word n-grams of that sequence (``shingle_size`` words, default 5,
joined by one space). A document with fewer words than ``shingle_size`` has one shingle (all its
words); an empty document has no shingles, so all empty documents share one signature and are
duplicates of each other.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from datasketch import MinHash

from tools.hygiene.jsonl import parse_document

_NON_WORD = re.compile(r"[^\w\s]|_")
# datasketch's current default scheme; fixed so signatures stay comparable across versions.
SCHEME = "affine32"


@dataclass(frozen=True, kw_only=True)
class ShingleConfig:
    """How documents are turned into MinHash signatures."""

    shingle_size: int = 5
    num_perm: int = 128
    seed: int = 1
    text_key: str = "text"
    id_key: str | None = "id"
    source: str = "<input>"


def normalise_words(text: str) -> list[str]:
    """Apply the normalisation rule of this module and return the words."""
    return _NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).lower()).split()


def shingles(words: Sequence[str], size: int) -> set[str]:
    """The set of word ``size``-grams of ``words`` (one shingle of all words when shorter)."""
    if not words:
        return set()
    if len(words) < size:
        return {" ".join(words)}
    return {" ".join(words[i : i + size]) for i in range(len(words) - size + 1)}


def exact_jaccard(a: set[str], b: set[str]) -> float:
    """Exact Jaccard similarity of two shingle sets (1.0 for two empty sets)."""
    union = len(a | b)
    return 1.0 if union == 0 else len(a & b) / union


@functools.lru_cache(maxsize=4)
def _permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    # Building the permutations draws num_perm random pairs; do it once per process, not per doc.
    return MinHash(num_perm=num_perm, seed=seed, scheme=SCHEME).permutations


def signature(text: str, config: ShingleConfig) -> np.ndarray:
    """The MinHash hash values (``uint32[num_perm]``) of a document's shingle set."""
    minhash = MinHash(
        num_perm=config.num_perm,
        seed=config.seed,
        permutations=_permutations(config.num_perm, config.seed),
        scheme=SCHEME,
    )
    minhash.update_batch(s.encode("utf-8") for s in shingles(normalise_words(text), config.shingle_size))
    return np.asarray(minhash.hashvalues, dtype=np.uint32)


def signature_chunk(chunk: list[tuple[int, bytes]], config: ShingleConfig) -> tuple[np.ndarray, list]:
    """Signatures (``[len(chunk), num_perm]``) and ids of a chunk of ``(line, raw JSON)`` pairs.

    Runs in worker processes; a bad line raises :class:`UserError`, re-raised in the parent.
    """
    sigs = np.empty((len(chunk), config.num_perm), dtype=np.uint32)
    ids = []
    for row, (line, raw) in enumerate(chunk):
        doc = parse_document(
            raw, line=line, source=config.source, text_key=config.text_key, id_key=config.id_key
        )
        sigs[row] = signature(doc.text, config)
        ids.append(doc.doc_id)
    return sigs, ids
