"""Embeddings and the language-model trunk shared by GPT and BERT."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config import ModelConfig
from pretrain.models.transformer import DTYPES, TransformerBlock, layer_norm
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding, mark_partition
from pretrain.tensor_parallel.mappings import copy_to_tp_region, gather_from_tp_region
from pretrain.tensor_parallel.sequence_parallel import mark_sequence_parallel
from pretrain.tensor_parallel.vocab import padded_vocab_size


class Embedding(nn.Module):
    """Word (vocab-parallel ``[V/t, h]``) + learned position (+ token-type) embeddings, dropout.

    With ``position_embedding_type="rope"`` there are no position embeddings (the attention
    rotates queries and keys instead).

    Output ``[b, s, h]``, replicated on TP ranks (the word lookup all-reduces over the TP group),
    or with ``cfg.sequence_parallel`` this rank's sequence shard ``[b, s/t, h]``: the word lookup
    reduce-scatters, the other embeddings are looked up at this rank's positions only (their
    weights are ``sequence_parallel``), and the (post-LN) norm and dropout run on the shard
    (dropout under the TP-region generator).
    """

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        dtype = DTYPES[cfg.params_dtype]
        padded = padded_vocab_size(
            cfg.vocab_size, tp=ps.tp_size, divisible_by=cfg.make_vocab_size_divisible_by
        )
        self.sequence_parallel = cfg.sequence_parallel and ps.tp_size > 1
        self.tp_rank, self.tp_size, self.rng = ps.tp_rank, ps.tp_size, ps.rng
        self.word_embeddings = VocabParallelEmbedding(
            padded, cfg.hidden_size, ps=ps, dtype=dtype, sequence_parallel=self.sequence_parallel
        )
        if cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(
                cfg.max_position_embeddings, cfg.hidden_size, device=ps.device, dtype=dtype
            )
            mark_partition(self.position_embeddings.weight, None)
        if cfg.num_tokentypes > 0:
            self.tokentype_embeddings = nn.Embedding(
                cfg.num_tokentypes, cfg.hidden_size, device=ps.device, dtype=dtype
            )
        if cfg.post_layernorm:
            self.layernorm = layer_norm(cfg, ps)
        if self.sequence_parallel:  # each rank sees its positions only: gradients summed over TP
            for name in ("position_embeddings", "tokentype_embeddings", "layernorm"):
                if hasattr(self, name):
                    mark_sequence_parallel(getattr(self, name))
        self.dropout = cfg.hidden_dropout
        self.max_positions = cfg.max_position_embeddings

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        tokentype_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        if hasattr(self, "position_embeddings"):
            s = input_ids.shape[-1]
            if s > self.max_positions:
                raise ValueError(f"sequence length {s} exceeds max_position_embeddings {self.max_positions}")
            if position_ids is None:
                position_ids = torch.arange(s, device=input_ids.device).expand_as(input_ids)
            x = x + self.position_embeddings(self._shard(position_ids))
        if hasattr(self, "tokentype_embeddings"):
            if tokentype_ids is None:
                tokentype_ids = torch.zeros_like(input_ids)
            x = x + self.tokentype_embeddings(self._shard(tokentype_ids))
        if hasattr(self, "layernorm"):
            x = self.layernorm(x)
        if self.dropout <= 0 or not self.training:
            return x
        with self.rng.fork() if self.sequence_parallel else contextlib.nullcontext():
            return F.dropout(x, self.dropout, True)

    def _shard(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [b|1, s]`` at this rank's sequence positions under sequence parallelism."""
        if not self.sequence_parallel:
            return ids
        return ids.chunk(self.tp_size, dim=-1)[self.tp_rank]


class LanguageModel(nn.Module):
    """``embedding`` (first stage only), ``encoder`` (this stage's layers) and, on the last stage
    of a model with untied embeddings, the vocab-parallel ``output_layer`` ``[V/t, h]``."""

    def __init__(
        self,
        cfg: ModelConfig,
        ps: ParallelState,
        *,
        pre_process: bool,
        post_process: bool,
        layer_numbers: Sequence[int],
    ) -> None:
        super().__init__()
        if pre_process:
            self.embedding = Embedding(cfg, ps)
        self.encoder = TransformerBlock(cfg, ps, layer_numbers=layer_numbers, final_layernorm=post_process)
        if post_process and cfg.untie_embeddings_and_output_weights:
            padded = padded_vocab_size(
                cfg.vocab_size, tp=ps.tp_size, divisible_by=cfg.make_vocab_size_divisible_by
            )
            self.output_layer = ColumnParallelLinear(
                cfg.hidden_size, padded, ps=ps, bias=False, dtype=DTYPES[cfg.params_dtype]
            )


def parallel_lm_logits(
    hidden: torch.Tensor,
    word_embeddings: torch.Tensor,
    *,
    ps: ParallelState,
    vocab_start: int,
    true_vocab: int,
) -> torch.Tensor:
    """Vocab-parallel logits ``[b, s, n]`` from ``hidden [b, s, h]`` and the (tied or untied) output
    weight ``[V/t, h]``.

    ``n`` is the number of *real* vocabulary rows on this rank (``V/t`` except on the rank that
    holds the padding): padded rows never reach the logits, so they cannot take probability mass,
    and their weight gradient is zero. On the CPU they are not multiplied at all. On an
    accelerator the GEMM runs over all ``V/t`` rows and their columns are dropped after it: an
    output width such as GPT-2's 50257 is not a multiple of 8, and cuBLAS then falls back to
    unaligned kernels (40 ms instead of ~2 for a 16k-token step of a 1.3B model on an H200).
    Collective: f on the input (backward all-reduce over the TP group).
    """
    valid = max(0, min(word_embeddings.shape[0], true_vocab - vocab_start))
    x = copy_to_tp_region(hidden, ps.tp_group)
    if valid == word_embeddings.shape[0]:
        return F.linear(x, word_embeddings)
    if not gemm_over_padded_rows(hidden.device):
        return F.linear(x, word_embeddings[:valid])
    return F.linear(x, word_embeddings)[..., :valid]


def gemm_over_padded_rows(device: torch.device) -> bool:
    """Whether :func:`parallel_lm_logits` multiplies the padded vocabulary rows too (then drops
    their columns): on accelerators, whose GEMM libraries want aligned widths; not on the CPU."""
    return device.type != "cpu"


def gather_vocab_logits(
    local_logits: torch.Tensor, *, ps: ParallelState, padded_vocab: int, true_vocab: int
) -> torch.Tensor:
    """All-gather ``[..., n]`` logits of every TP rank into ``[..., true_vocab]`` (autograd-aware)."""
    rows = padded_vocab // ps.tp_size
    if local_logits.shape[-1] < rows:  # the rank holding the padding: fill to the common width
        pad = local_logits.new_full((*local_logits.shape[:-1], rows - local_logits.shape[-1]), float("-inf"))
        local_logits = torch.cat([local_logits, pad], dim=-1)
    return gather_from_tp_region(local_logits, ps.tp_group)[..., :true_vocab]
