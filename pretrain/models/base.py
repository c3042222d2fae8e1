"""The interface every model stage exposes to sharding, initialisation and checkpoint code."""

from __future__ import annotations

import re

import torch
from torch import nn

from pretrain.config import ModelConfig
from pretrain.parallel.state import ParallelState

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"(\.mlp\.experts\.)(\d+)\.")


class ShardedModule(nn.Module):
    """A model stage (GPT or BERT trunk + heads) whose parameters map to canonical full tensors.

    Subclasses set ``cfg``, ``ps``, ``padded_vocab``, ``vocab_start``, ``pre_process`` and
    ``layer_numbers`` (global indices of the layers this stage holds, local ``layers.i``).
    """

    cfg: ModelConfig
    ps: ParallelState
    padded_vocab: int
    vocab_start: int
    pre_process: bool
    layer_numbers: tuple[int, ...]

    def canonical_name(self, name: str) -> str:
        """Local parameter name -> layout-independent name: local layer indices become global, so
        do the local expert indices of an expert-parallel rank (rank j holds experts
        ``[j E/EP, (j+1) E/EP)``), and the last stage's ``word_embeddings_for_head`` maps to the
        word embeddings it copies."""
        if name.startswith("word_embeddings_for_head."):
            return "language_model.embedding.word_embeddings." + name.split(".", 1)[1]
        name = _LAYER.sub(
            lambda m: f"{m.group(1)}layers.{self.layer_numbers[int(m.group(2))]}.", name, count=1
        )
        if self.ps.ep_size > 1:
            first = self.ps.ep_rank * (int(self.cfg.num_experts or 0) // self.ps.ep_size)
            name = _EXPERT.sub(lambda m: f"{m.group(1)}{first + int(m.group(2))}.", name, count=1)
        return name

    def shared_embedding_weight(self) -> torch.Tensor:
        """The tied word embeddings ``[V/t, h]``: the first stage's, or the last stage's copy."""
        if self.pre_process:
            return self.language_model.embedding.word_embeddings.weight  # type: ignore[union-attr,return-value]
        return self.word_embeddings_for_head.weight  # type: ignore[union-attr,return-value]
