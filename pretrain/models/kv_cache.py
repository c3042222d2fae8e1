"""Key/value cache for incremental decoding, one entry per transformer layer of a stage.

Each tensor-parallel rank caches only its own heads (the keys/values its column-parallel QKV
projection produced), and each pipeline stage only its own layers, so the cache is sharded
exactly like the model. Layout per layer: keys and values ``[b, heads/t, capacity, head_dim]``,
filled left to right; :meth:`LayerKVCache.update` appends the new positions and returns the
keys/values of every position so far. No collectives.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """The cached keys and values of one attention layer (this rank's heads)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k, v [b, heads, s_new, head_dim]``; return all ``[b, heads, length, head_dim]``."""
        b, heads, s, dim = k.shape
        if self.keys is None or self.values is None:
            self.keys = k.new_empty((b, heads, self.capacity, dim))
            self.values = v.new_empty((b, heads, self.capacity, v.shape[-1]))
        if self.length + s > self.capacity:
            raise ValueError(f"KV cache full: {self.length} + {s} positions exceed capacity {self.capacity}")
        self.keys[:, :, self.length : self.length + s] = k
        self.values[:, :, self.length : self.length + s] = v
        self.length += s
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]


class KVCache:
    """One :class:`LayerKVCache` per layer held by a model stage (local layer order)."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.layers = [LayerKVCache(capacity) for _ in range(num_layers)]

    @property
    def length(self) -> int:
        """Positions cached so far (the same for every layer after a full forward)."""
        return self.layers[0].length if self.layers else 0

    def layer(self, index: int) -> LayerKVCache:
        return self.layers[index]
