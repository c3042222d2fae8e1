"""The interface every model stage exposes to sharding, initialisation and checkpoint code."""

from __future__ import annotations

from torch import nn

from pretrain.config import ModelConfig
from pretrain.parallel.state import ParallelState


class ShardedModule(nn.Module):
    """A model stage whose parameters map to canonical full tensors.

    Subclasses set ``cfg``, ``ps``, ``padded_vocab`` and ``vocab_start`` and implement
    :meth:`canonical_name`.
    """

    cfg: ModelConfig
    ps: ParallelState
    padded_vocab: int
    vocab_start: int

    def canonical_name(self, name: str) -> str:
        """Layout-independent name of local parameter ``name``."""
        raise NotImplementedError
