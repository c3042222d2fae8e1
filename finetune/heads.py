"""Finetuning heads on the BERT trunk: small dense layers held whole on every TP rank.

They live on the last pipeline stage, next to the pooler, and are named like upstream Megatron
(``classification_head.{weight,bias}`` of ``tasks/glue``, ``multichoice_head.{weight,bias}`` of
``tasks/race``; SQuAD, which upstream never had, uses ``span_head.{weight,bias}``). Each head is
an ``nn.Linear`` itself so the parameter names carry no extra level. Dropout runs on the default
generator, which is seeded alike on all TP ranks, so replicated heads stay identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config import ModelConfig
from pretrain.models.transformer import DTYPES
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.layers import mark_partition
from pretrain.utils.errors import UserError

HeadKind = Literal["classification", "span", "multichoice"]
HEAD_ATTRS: dict[str, str] = {
    "classification": "classification_head",
    "span": "span_head",
    "multichoice": "multichoice_head",
}


@dataclass(frozen=True, kw_only=True)
class HeadConfig:
    """Which head: ``classification`` (``num_labels`` classes, 1 = regression), ``span`` (start
    and end logits per token) or ``multichoice`` (``num_choices`` encodings per question)."""

    kind: HeadKind
    num_labels: int = 2
    num_choices: int = 4

    def __post_init__(self) -> None:
        if self.kind not in HEAD_ATTRS:
            raise UserError(f"unknown head kind {self.kind!r}; expected one of {', '.join(HEAD_ATTRS)}")
        if self.num_labels < 1 or self.num_choices < 2:
            raise UserError(f"head: num_labels {self.num_labels} / num_choices {self.num_choices} too small")

    @property
    def needs_pooler(self) -> bool:
        return self.kind != "span"


class _ReplicatedHead(nn.Linear):
    """``dense(dropout(x))`` with weight ``[out, h]`` replicated over the TP group."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState, out_features: int, dropout: float) -> None:
        super().__init__(cfg.hidden_size, out_features, device=ps.device, dtype=DTYPES[cfg.params_dtype])
        mark_partition(self.weight, None)
        mark_partition(self.bias, None)
        self.dropout = dropout

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout > 0:
            x = F.dropout(x, self.dropout, self.training)
        return super().forward(x)


class ClassificationHead(_ReplicatedHead):
    """Pooled ``[b, h]`` -> logits ``[b, num_labels]`` (``[b, 1]`` for regression)."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState, num_labels: int) -> None:
        super().__init__(cfg, ps, num_labels, cfg.hidden_dropout)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self._dense(pooled)


class MultipleChoiceHead(_ReplicatedHead):
    """Pooled ``[b * c, h]`` (``c`` encodings per question, consecutive) -> scores ``[b, c]``."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState, num_choices: int) -> None:
        super().__init__(cfg, ps, 1, cfg.hidden_dropout)
        self.num_choices = num_choices

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self._dense(pooled).view(-1, self.num_choices)


class SpanHead(_ReplicatedHead):
    """Hidden states ``[b, s, h]`` -> ``[b, s, 2]`` (start, end logits); no dropout (as BERT)."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__(cfg, ps, 2, 0.0)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._dense(hidden)


def build_head(cfg: ModelConfig, ps: ParallelState, head: HeadConfig) -> nn.Module:
    """The head module for ``head`` (attribute name: ``HEAD_ATTRS[head.kind]``)."""
    if head.kind == "classification":
        return ClassificationHead(cfg, ps, head.num_labels)
    if head.kind == "multichoice":
        return MultipleChoiceHead(cfg, ps, head.num_choices)
    return SpanHead(cfg, ps)
