"""The finetuning model: BERT trunk (embeddings, layers, pooler) plus one head, one pipeline stage.

Canonical names (inherited from :class:`ShardedModule`) are BertModel's for the trunk
(``language_model.*`` with global layer numbers) plus the head's (:mod:`finetune.heads`), so a
pretrained BERT's canonical tensors load directly and finetuned checkpoints keep Megatron's
names. There is no masked-LM head and no binary head, hence no tied output embedding: pipeline
stages share nothing (``shared_embedding_weight`` is ``None``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from finetune.heads import HEAD_ATTRS, HeadConfig, build_head
from pretrain.config import ModelConfig
from pretrain.models.base import ShardedModule
from pretrain.models.bert import BertLanguageModel, bert_trunk
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.vocab import padded_vocab_size
from pretrain.utils.errors import UserError


class FinetuneModel(ShardedModule):
    """One stage of BERT + head. The last stage returns the head's output (see :meth:`forward`)."""

    def __init__(
        self, cfg: ModelConfig, ps: ParallelState, *, head: HeadConfig, pre_process: bool = True,
        post_process: bool = True, layer_numbers: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        if not cfg.bidirectional:
            raise UserError("finetuning needs a BERT (bidirectional) model config")
        cfg.check_tensor_parallel(ps.tp_size)
        self.cfg, self.ps, self.head_cfg = cfg, ps, head
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_numbers = tuple(range(cfg.num_layers) if layer_numbers is None else layer_numbers)
        self.language_model = BertLanguageModel(
            cfg, ps, pre_process=pre_process, post_process=post_process, layer_numbers=self.layer_numbers,
            add_pooler=post_process and head.needs_pooler,
        )  # fmt: skip
        self.padded_vocab = padded_vocab_size(
            cfg.vocab_size, tp=ps.tp_size, divisible_by=cfg.make_vocab_size_divisible_by
        )
        self.vocab_start = ps.tp_rank * (self.padded_vocab // ps.tp_size)
        if post_process:
            setattr(self, HEAD_ATTRS[head.kind], build_head(cfg, ps, head))

    def shared_embedding_weight(self) -> torch.Tensor | None:  # type: ignore[override]
        """No tied output embedding (no LM head): nothing to sync between first and last stage."""
        return None

    @property
    def head(self) -> torch.nn.Module:
        return getattr(self, HEAD_ATTRS[self.head_cfg.kind])  # type: ignore[no-any-return]

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        tokentype_ids: torch.Tensor | None = None,
        *,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """First stage: ``input_ids``/``tokentype_ids [B, s]``; later stages ``hidden_states [B, s, h]``;
        every stage ``attention_mask [B, s]`` (1 = real token). Multiple choice: ``B = b * c``.

        Returns hidden states ``[B, s, h]`` (not the last stage) or the head output: classification
        logits ``[B, num_labels]``, multiple-choice scores ``[b, c]``, span logits ``[B, s, 2]``.
        Collectives: the TP all-reduces of the trunk; the head is local.
        """
        x = bert_trunk(self, input_ids, attention_mask, tokentype_ids, hidden_states)
        if not self.post_process:
            return x
        if self.head_cfg.needs_pooler:
            return self.head(self.language_model.pooler(x))  # type: ignore[no-any-return]
        return self.head(x)  # type: ignore[no-any-return]


def finetune_model_provider(head: HeadConfig) -> Callable[..., ShardedModule]:
    """A ``model_cls`` for :func:`pretrain.pipeline.partition.build_model_chunks`."""

    def build(cfg: ModelConfig, ps: ParallelState, **kw: Any) -> ShardedModule:
        return FinetuneModel(cfg, ps, head=head, **kw)

    return build


def finetune_forward_step(
    model: ShardedModule, mb: dict[str, torch.Tensor], hidden: torch.Tensor | None, is_last: bool
) -> Any:
    """Stage forward for :func:`pretrain.pipeline.schedules.forward_backward`: ``mb`` holds
    ``tokens``, ``tokentype_ids``, ``attention_mask`` ``[B, s]`` plus the task's labels."""
    kwargs: dict[str, Any] = {"attention_mask": mb["attention_mask"]}
    if hidden is None:
        kwargs.update(input_ids=mb["tokens"], tokentype_ids=mb["tokentype_ids"])
    else:
        kwargs["hidden_states"] = hidden
    return model(**kwargs)
