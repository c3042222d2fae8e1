"""GPT: pre-LN decoder-only transformer (GPT-2, and Llama-family decoders by configuration).

The output layer is tied to the word embeddings (GPT-2) or, with
``untie_embeddings_and_output_weights``, a separate vocab-parallel ``language_model.output_layer``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pretrain.config import ModelConfig
from pretrain.models.base import ShardedModule
from pretrain.models.cpu_gemm import resolve as resolve_cpu_gemm
from pretrain.models.forward_context import ForwardContext
from pretrain.models.language_model import LanguageModel, gather_vocab_logits, parallel_lm_logits
from pretrain.models.lm_loss import fused_loss_ok, lm_head_cross_entropy
from pretrain.models.transformer import DTYPES
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from pretrain.tensor_parallel.layers import VocabParallelEmbedding
from pretrain.tensor_parallel.vocab import padded_vocab_size


class GPTModel(ShardedModule):
    """One pipeline stage (or virtual chunk) of GPT.

    * ``pre_process`` (first stage): holds ``language_model.embedding``; ``forward`` takes ids.
    * ``post_process`` (last stage): holds ``encoder.final_layernorm`` and computes logits with
      the word embeddings; on a last stage that is not also first, a copy of them lives in
      ``word_embeddings_for_head`` (kept equal via the embedding group, see pipeline code).
    * ``layer_numbers``: global indices of the layers here (default: all layers).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        ps: ParallelState,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        layer_numbers: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        cfg.check_tensor_parallel(ps.tp_size)
        self.cfg, self.ps = cfg, ps
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_numbers = tuple(range(cfg.num_layers) if layer_numbers is None else layer_numbers)
        self.language_model = LanguageModel(
            cfg, ps, pre_process=pre_process, post_process=post_process, layer_numbers=self.layer_numbers
        )
        self.padded_vocab = padded_vocab_size(
            cfg.vocab_size, tp=ps.tp_size, divisible_by=cfg.make_vocab_size_divisible_by
        )
        self.vocab_start = ps.tp_rank * (self.padded_vocab // ps.tp_size)
        if post_process and not pre_process and not cfg.untie_embeddings_and_output_weights:
            self.word_embeddings_for_head = VocabParallelEmbedding(
                self.padded_vocab, cfg.hidden_size, ps=ps, dtype=DTYPES[cfg.params_dtype]
            )

    # --- compute -------------------------------------------------------------------------------
    def trunk(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        hidden_states: torch.Tensor | None = None,
        ctx: ForwardContext | None = None,
    ) -> torch.Tensor:
        """This stage's hidden states: the embedding (first stage, ``input_ids [b, s]``) or the
        received ``hidden_states [b, s, h]``, then the layers (and the final LayerNorm on the last
        stage): ``[b, s, h]``, or ``[b, n, h]`` with ``ctx.query_index [b, n]``.

        The one forward of the decoder: training, scoring, the harness backend and generation all
        run it (see :class:`~pretrain.models.forward_context.ForwardContext` for masks, positions,
        KV cache and query pruning). Collectives: the TP all-reduces of the embedding and layers.
        """
        ctx = ctx or ForwardContext()
        if self.pre_process:
            assert input_ids is not None, "the first stage needs input_ids"
            x = self.language_model.embedding(input_ids, ctx.position_ids)
        else:
            assert hidden_states is not None, "a later stage needs hidden_states"
            x = hidden_states
        return self.language_model.encoder(x, ctx)  # type: ignore[no-any-return]

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        hidden_states: torch.Tensor | None = None,
        ctx: ForwardContext | None = None,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`trunk`, then on the last stage the output layer.

        Returns hidden states ``[b, s, h]`` (not last stage), per-token losses ``[b, s]`` (last
        stage with ``labels``; ``[b, n]`` with ``ctx.query_index``), or vocab-parallel logits
        ``[b, s, V/t]`` (last stage). ``loss_mask [b, s]`` (with ``labels``): only the tokens where
        it is not 0 reach the output layer (an SFT prompt's and padding's rows are never
        multiplied); the others get loss 0 and no gradient. Collectives: those of :meth:`trunk`;
        f on the output layer's input; with ``labels`` the vocab-parallel cross entropy's
        all-reduces over the TP group (every TP rank holds the same mask, so the same rows).
        """
        x = self.trunk(input_ids, hidden_states=hidden_states, ctx=ctx)
        if not self.post_process:
            return x
        if labels is not None and loss_mask is not None:
            rows = loss_mask.reshape(-1).nonzero().squeeze(-1)  # (one host sync on an accelerator)
            if rows.numel() < loss_mask.numel():
                return self._loss_of_rows(x, labels, rows)
        return self._output(x, labels)

    def _loss_of_rows(self, x: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Per-token losses ``[b, s]``: the output layer and loss on the flattened token ``rows``
        ``[n]`` of ``x [b, s, h]`` only (as one ``[1, n]`` sequence: both are row-wise), 0 elsewhere."""
        kept_x = x.reshape(-1, x.shape[-1]).index_select(0, rows).unsqueeze(0)
        kept = self._output(kept_x, labels.reshape(-1).index_select(0, rows).unsqueeze(0))
        # autograd: the kept rows' input gradients are scattered back into zeros [b * s, h]
        return kept.new_zeros(labels.numel()).index_put((rows,), kept.reshape(-1)).view(labels.shape)

    def _output(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The output layer on ``x [b, s, h]``: per-token losses ``[b, s]`` with ``labels``, else
        vocab-parallel logits ``[b, s, V/t]``."""
        weight = self.output_weight()
        if labels is not None and fused_loss_ok(x, weight, self.ps.tp_size):  # a frozen head (LoRA)
            valid = min(weight.shape[0], self.cfg.vocab_size)  # no padded rows, as parallel_lm_logits
            # out-of-range targets (masked out by the caller) get the loss of class 0, as below
            safe = labels.masked_fill((labels < 0) | (labels >= valid), 0)
            return lm_head_cross_entropy(x, weight[:valid], safe, gemm=resolve_cpu_gemm(self.cfg.cpu_gemm))
        logits = parallel_lm_logits(
            x,
            weight,
            ps=self.ps,
            vocab_start=self.vocab_start,
            true_vocab=self.cfg.vocab_size,
        )
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(
            logits, labels, vocab_start=self.vocab_start, group=self.ps.tp_group
        )

    def shared_embedding_weight(self) -> torch.Tensor | None:  # type: ignore[override]
        """The tied word embeddings ``[V/t, h]`` (None when the output layer is untied)."""
        if self.cfg.untie_embeddings_and_output_weights:
            return None
        return super().shared_embedding_weight()

    def output_weight(self) -> torch.Tensor:
        """The output layer's weight ``[V/t, h]`` on the last stage: tied embeddings or ``output_layer``."""
        if self.cfg.untie_embeddings_and_output_weights:
            return self.language_model.output_layer.weight  # type: ignore[union-attr,return-value]
        return super().shared_embedding_weight()

    def full_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Gather vocab-parallel logits ``[b, s, n]`` over the TP group into ``[b, s, V]`` (no padding).

        Collective: one all-gather over the TP group (evaluation only; training never gathers).
        """
        return gather_vocab_logits(
            local_logits, ps=self.ps, padded_vocab=self.padded_vocab, true_vocab=self.cfg.vocab_size
        )
