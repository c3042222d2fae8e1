"""The dtype and shape of a source's canonical tensor, without reading its data.

Streaming writers announce every tensor before its bytes (a safetensors header, a rank file's
pickle), so they ask for each tensor's dtype and shape first. Readers answer from what they
already hold (``tensor_meta(name)``: the mmap'd rank files' tensors, ``torch_dist``'s
``.metadata``); any other source's ``tensor(name)`` is run on fake tensors (shapes only, no data
read) and, should that fail (a data-dependent check), read for real.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from pretrain.checkpoint.types import DictSource, LazySource, TensorSource

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode


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
        with _fake_mode():
            fake = source.tensor(name)
        meta = torch.empty(fake.shape, dtype=fake.dtype, device="meta")
    except Exception:  # noqa: BLE001  # a data-dependent step: read it
        meta = meta_like(source.tensor(name))
    if cache is not None:
        cache[name] = meta
    return meta


@functools.cache
def _fake_mode() -> FakeTensorMode:
    """One fake mode for every dry run: making one costs more than a tensor's dry run (about 4 ms,
    tens of thousands of calls in a large checkpoint's conversion); it keeps no state between runs
    that changes their results (its memo of converted inputs is weakly keyed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)
