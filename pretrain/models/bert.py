"""BERT: bidirectional encoder with the masked-LM head and the sentence-order (binary) head.

Megatron legacy names (paper sections 4.2 and 5.3, figure 7): ``language_model.embedding``
(word, position and ``tokentype_embeddings``; plus ``layernorm`` for post-LN),
``language_model.encoder.layers.{i}``, ``language_model.encoder.final_layernorm`` (pre-LN),
``language_model.pooler.dense``, ``lm_head.{dense,layernorm,bias}`` and ``binary_head``.

The MLM head is dense -> GeLU -> LayerNorm (replicated on TP ranks), then the decoder tied to
the vocab-parallel word embeddings plus the vocab-parallel ``lm_head.bias [V/t]``, so logits and
the cross-entropy stay split over the vocabulary (only per-token scalars cross the TP group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config import ModelConfig
from pretrain.models.base import ShardedModule
from pretrain.models.forward_context import ForwardContext
from pretrain.models.language_model import LanguageModel, gather_vocab_logits, parallel_lm_logits
from pretrain.models.transformer import DTYPES, layer_norm
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from pretrain.tensor_parallel.layers import VocabParallelEmbedding, mark_partition
from pretrain.tensor_parallel.vocab import padded_vocab_size
from pretrain.utils.errors import UserError

BertOutput = tuple[torch.Tensor, "torch.Tensor | None"]


def _replicated_linear(cfg: ModelConfig, ps: ParallelState, out_features: int) -> nn.Linear:
    """A small dense layer held whole on every TP rank (pooler, head transform, binary head)."""
    lin = nn.Linear(cfg.hidden_size, out_features, device=ps.device, dtype=DTYPES[cfg.params_dtype])
    mark_partition(lin.weight, None)
    mark_partition(lin.bias, None)
    return lin


class Pooler(nn.Module):
    """``tanh(dense(hidden[:, 0]))``: ``[b, s, h] -> [b, h]`` (the [CLS] token), no communication."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        self.dense = _replicated_linear(cfg, ps, cfg.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class BertLanguageModel(LanguageModel):
    """:class:`LanguageModel` plus the ``pooler`` (last stage with the binary head)."""

    def __init__(
        self, cfg: ModelConfig, ps: ParallelState, *, pre_process: bool, post_process: bool,
        layer_numbers: Sequence[int], add_pooler: bool,
    ) -> None:  # fmt: skip
        super().__init__(
            cfg, ps, pre_process=pre_process, post_process=post_process, layer_numbers=layer_numbers
        )
        if add_pooler:
            self.pooler = Pooler(cfg, ps)


class BertLMHead(nn.Module):
    """dense -> GeLU -> LayerNorm -> tied decoder + vocab-parallel bias.

    ``hidden [b, s, h]`` -> logits ``[b, s, n]``, ``n`` = the real (unpadded) vocabulary rows of
    this rank, as :func:`parallel_lm_logits`. Collective: f on the decoder input (backward
    all-reduce over the TP group).
    """

    def __init__(self, cfg: ModelConfig, ps: ParallelState, padded_vocab: int, vocab_start: int) -> None:
        super().__init__()
        self.dense = _replicated_linear(cfg, ps, cfg.hidden_size)
        self.layernorm = layer_norm(cfg, ps)
        local = padded_vocab // ps.tp_size
        bias = torch.empty(local, device=ps.device, dtype=DTYPES[cfg.params_dtype])
        self.bias = mark_partition(nn.Parameter(bias), 0)
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"
        self.ps, self.vocab_start, self.true_vocab = ps, vocab_start, cfg.vocab_size

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        x = self.layernorm(F.gelu(self.dense(hidden), approximate=self.approximate))
        logits = parallel_lm_logits(
            x, word_embeddings, ps=self.ps, vocab_start=self.vocab_start, true_vocab=self.true_vocab
        )
        # Padded vocabulary rows are never multiplied: use the bias entries of the real rows only.
        return logits + self.bias[: logits.shape[-1]]


def bert_trunk(
    model: ShardedModule,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    tokentype_ids: torch.Tensor | None,
    hidden_states: torch.Tensor | None,
) -> torch.Tensor:
    """This stage's encoder output ``[b, s, h]``: embeddings (first stage) or received hidden states,
    then the stage's layers under the padding mask. Shared by pretraining and finetuning models."""
    mask = None if attention_mask is None else padding_attention_mask(attention_mask)
    lm: Any = model.language_model
    if model.pre_process:
        if input_ids is None:
            raise ValueError("the first BERT stage needs input_ids")
        x = lm.embedding(input_ids, None, tokentype_ids)
    else:
        if hidden_states is None:
            raise ValueError("a later BERT stage needs hidden_states")
        x = hidden_states
    return lm.encoder(x, ForwardContext(attn_mask=mask))  # type: ignore[no-any-return]


def padding_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` (1 = real token) -> bool ``[b, 1, 1, s]``: every query may attend to real keys.

    Only keys are masked (as Hugging Face does); masking padded queries too would leave rows
    with nothing to attend to, which SDPA turns into NaN. Padded positions' outputs are unused.
    """
    return attention_mask.bool()[:, None, None, :]


class BertModel(ShardedModule):
    """One pipeline stage (or virtual chunk) of BERT; see the module docstring for the names.

    ``cfg`` must be ``bidirectional``; ``num_tokentypes`` is 2 for the usual [CLS] A [SEP] B
    [SEP] input. ``add_binary_head`` adds ``pooler`` and ``binary_head`` (sentence order) on the
    last stage; a last stage that is not first keeps ``word_embeddings_for_head`` (as GPT).
    """

    def __init__(
        self, cfg: ModelConfig, ps: ParallelState, *, pre_process: bool = True, post_process: bool = True,
        layer_numbers: Sequence[int] | None = None, add_binary_head: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        if not cfg.bidirectional:
            raise UserError("BERT needs a bidirectional model config (bidirectional=True)")
        if cfg.num_tokentypes < 0:
            raise UserError(f"model config: num_tokentypes must be >= 0, got {cfg.num_tokentypes}")
        cfg.check_tensor_parallel(ps.tp_size)
        self.cfg, self.ps = cfg, ps
        self.pre_process, self.post_process = pre_process, post_process
        self.add_binary_head = add_binary_head
        self.layer_numbers = tuple(range(cfg.num_layers) if layer_numbers is None else layer_numbers)
        self.language_model = BertLanguageModel(
            cfg, ps, pre_process=pre_process, post_process=post_process, layer_numbers=self.layer_numbers,
            add_pooler=post_process and add_binary_head,
        )  # fmt: skip
        self.padded_vocab = padded_vocab_size(
            cfg.vocab_size, tp=ps.tp_size, divisible_by=cfg.make_vocab_size_divisible_by
        )
        self.vocab_start = ps.tp_rank * (self.padded_vocab // ps.tp_size)
        if post_process:
            self.lm_head = BertLMHead(cfg, ps, self.padded_vocab, self.vocab_start)
            if add_binary_head:
                self.binary_head = _replicated_linear(cfg, ps, 2)
            if not pre_process:
                self.word_embeddings_for_head = VocabParallelEmbedding(
                    self.padded_vocab, cfg.hidden_size, ps=ps, dtype=DTYPES[cfg.params_dtype]
                )

    # --- compute -------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        tokentype_ids: torch.Tensor | None = None,
        *,
        hidden_states: torch.Tensor | None = None,
        lm_labels: torch.Tensor | None = None,
    ) -> torch.Tensor | BertOutput:
        """First stage: ``input_ids [b, s]`` and ``tokentype_ids [b, s]``; later stages:
        ``hidden_states [b, s, h]``. Every stage: ``attention_mask [b, s]`` (1 = real token;
        None = no padding).

        Returns hidden states ``[b, s, h]`` (not last stage) or ``(lm_output, sop_logits)``:
        ``lm_output`` is per-token MLM losses ``[b, s]`` with ``lm_labels`` (positions whose label
        is outside the vocabulary, e.g. -1, give finite values to be masked out by the loss mask),
        else vocab-parallel logits ``[b, s, n]`` (this rank's real vocabulary rows); ``sop_logits [b, 2]`` or None without the
        binary head. Collectives: TP all-reduces of the layers and the vocab-parallel head.
        """
        x = bert_trunk(self, input_ids, attention_mask, tokentype_ids, hidden_states)
        if not self.post_process:
            return x
        sop_logits = None
        if self.add_binary_head:
            sop_logits = self.binary_head(self.language_model.pooler(x))
        logits = self.lm_head(x, self.shared_embedding_weight())
        if lm_labels is None:
            return logits, sop_logits
        losses = vocab_parallel_cross_entropy(
            logits, lm_labels, vocab_start=self.vocab_start, group=self.ps.tp_group
        )
        return losses, sop_logits

    def full_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Gather vocab-parallel logits ``[b, s, n]`` over the TP group into ``[b, s, V]``.

        Collective: one all-gather over the TP group (evaluation only; training never gathers).
        """
        return gather_vocab_logits(
            local_logits, ps=self.ps, padded_vocab=self.padded_vocab, true_vocab=self.cfg.vocab_size
        )


def bert_model_provider(*, add_binary_head: bool = True) -> Callable[..., ShardedModule]:
    """A ``model_cls`` for :func:`pretrain.pipeline.partition.build_model_chunks`."""

    def build(cfg: ModelConfig, ps: ParallelState, **kw: Any) -> ShardedModule:
        return BertModel(cfg, ps, add_binary_head=add_binary_head, **kw)

    return build


# --- pipeline hooks ------------------------------------------------------------------------------


def bert_forward_step(model: ShardedModule, mb: dict[str, torch.Tensor], hidden: torch.Tensor | None,
                      is_last: bool) -> Any:  # fmt: skip
    """BERT stage forward for :func:`pretrain.pipeline.schedules.forward_backward`.

    ``mb``: ``tokens``, ``tokentype_ids``, ``attention_mask``, ``labels`` (``[b, s]``) and
    ``is_random`` ``[b]``. The last stage returns ``(per-token MLM losses [b, s], sop_logits)``.
    """
    kwargs: dict[str, Any] = {"attention_mask": mb.get("attention_mask")}
    if hidden is None:
        kwargs.update(input_ids=mb["tokens"], tokentype_ids=mb.get("tokentype_ids"))
    else:
        kwargs["hidden_states"] = hidden
    return model(lm_labels=mb["labels"] if is_last else None, **kwargs)


def bert_loss_terms(
    output: BertOutput, mb: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Unnormalised sums for one microbatch: (masked MLM loss sum, SOP loss sum or None), fp32."""
    lm_losses, sop_logits = output
    mlm_sum = (lm_losses.float() * mb["loss_mask"].float()).sum()
    if sop_logits is None:
        return mlm_sum, None
    sop_sum = F.cross_entropy(sop_logits.float(), mb["is_random"].long().view(-1), reduction="sum")
    return mlm_sum, sop_sum


def bert_loss_fn(
    output: BertOutput,
    mb: dict[str, torch.Tensor],
    *,
    num_masked_tokens: float | torch.Tensor,
    num_samples: float | torch.Tensor,
) -> torch.Tensor:
    """MLM loss averaged over the masked tokens of the global batch plus the SOP loss averaged
    over its samples (Megatron adds the two). Pass the global-batch normalisers with
    ``functools.partial``; summing this over all microbatches (and data-parallel ranks) gives the
    global-batch loss, so gradients match one process on the whole batch. No communication."""
    mlm_sum, sop_sum = bert_loss_terms(output, mb)
    loss = mlm_sum / num_masked_tokens
    return loss if sop_sum is None else loss + sop_sum / num_samples
