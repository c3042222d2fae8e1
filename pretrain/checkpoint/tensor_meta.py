"""The dtype and shape of a source's canonical tensor, without reading its data.

Streaming writers announce every tensor before its bytes (a safetensors header, a rank file's
pickle), so they ask for each tensor's dtype and shape first. Readers answer from what they
already hold (``tensor_meta(name)``: the mmap'd rank files' tensors, ``torch_dist``'s
``.metadata``); any other source's ``tensor(name)`` is run on shapes alone
(:mod:`~pretrain.utils.shape_probe`: no data read) and, should that fail (a data-dependent
check), read for real.
"""

from __future__ import annotations

import torch

from pretrain.checkpoint.types import DictSource, LazySource, TensorSource
from pretrain.utils.shape_probe import shape_of


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A ``meta`` tensor of ``t``'s dtype and shape (no memory)."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def tensor_meta(source: TensorSource, name: str) -> torch.Tensor:
    """``meta_like(source.tensor(name))``, reading as little as the source allows."""
    own = getattr(source, "tensor_meta", None)
    if callable(own):
        meta = own(name)
        assert isinstance(meta, torch.Tensor)
        return meta
    if isinstance(source, DictSource):
        return meta_like(source.tensor(name))
    cache = source.meta_cache if isinstance(source, LazySource) else None
    if cache is not None and name in cache:  # writers ask once per rank file: the dry run once
        return cache[name]
    try:
        meta = shape_of(lambda: source.tensor(name))
    except Exception:  # noqa: BLE001  # a data-dependent step: read it
        meta = meta_like(source.tensor(name))
    if cache is not None:
        cache[name] = meta
    return meta
