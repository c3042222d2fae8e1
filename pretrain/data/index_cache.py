"""On-disk caches of index arrays, keyed by everything they depend on, and dataset identities.

``{cache_dir}/{hash}-{kind}-{split}-{name}.npy`` plus a ``...-description.json`` written last, so a
cache is used only when its description equals the one asked for; files are written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.utils.atomic import atomic_open

MAPS_VERSION = 1  # bump when the construction of any cached index array changes

_HASH_MEMO: dict[tuple[str, int, int], str] = {}


def file_digest(path: str) -> str:
    """``blake2b`` of a file's bytes (memoised per path, size and modification time)."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _HASH_MEMO:
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(8 << 20), b""):
                h.update(chunk)
        _HASH_MEMO[key] = h.hexdigest()
    return _HASH_MEMO[key]


def data_hash(blend: Sequence[tuple[str, float | None]]) -> str:
    """The identity of a ``--data-path`` blend for checkpoint provenance: ``blake2b`` over each
    prefix's weight and the digest of its ``.idx`` file (document and sequence sizes; cheap to read,
    independent of where the files lie)."""
    h = hashlib.blake2b(digest_size=16)
    for prefix, weight in blend:
        h.update(f"{weight!r}:{file_digest(prefix + '.idx')};".encode())
    return f"idx-b2:{h.hexdigest()}"


def _description_hash(desc: dict[str, Any]) -> str:
    return hashlib.md5(json.dumps(desc, sort_keys=True).encode(), usedforsecurity=False).hexdigest()


class IndexCache:
    """``{cache_dir}/{hash}-{kind}-{split}-{name}.npy`` + ``...-description.json`` (written last)."""

    def __init__(
        self, cache_dir: str | None, kind: str, split: str, desc: dict[str, Any], names: Sequence[str]
    ):
        self.desc = desc
        self.unique = _description_hash(desc)
        self.names = list(names)
        self.dir = Path(cache_dir) if cache_dir is not None else None
        stem = f"{self.unique}-{kind}-{split}"
        self.paths = {n: self.dir / f"{stem}-{n}.npy" for n in self.names} if self.dir else {}
        self.desc_path = self.dir / f"{stem}-description.json" if self.dir else None

    def load(self) -> dict[str, np.ndarray] | None:
        if self.desc_path is None or not self.desc_path.is_file():
            return None
        try:
            if json.loads(self.desc_path.read_text(encoding="utf-8")) != self.desc:
                return None
            return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in self.paths.items()}
        except (OSError, ValueError):  # missing or corrupt: rebuild
            return None

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        if self.dir is None or self.desc_path is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in self.names:
            with atomic_open(self.paths[name], "wb") as fh:
                np.save(fh, np.ascontiguousarray(arrays[name]), allow_pickle=False)
        with atomic_open(self.desc_path, "w", encoding="utf-8") as fh:
            json.dump(self.desc, fh, indent=2, sort_keys=True)
            fh.write("\n")
