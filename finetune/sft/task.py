"""SFT as a :class:`~pretrain.training.task.TrainTask` of the one training loop, and ``valid_loss``.

The model is the GPT (any Llama-family decoder) at any TP x PP x DP layout; a microbatch is rows
of :mod:`finetune.sft.packing`. The training loss of a global batch is its masked NLL sum divided
by its number of loss tokens over all DP ranks (as pretraining's ``--eod-mask-loss`` loss), so each
layout takes one process's step. :func:`valid_loss` is the token-weighted mean NLL over every loss
token of a whole file, summed in float64: the same number in every layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from finetune.sft.packing import Rows, block_causal_mask
from finetune.tasks import rows_to_microbatches
from pretrain.checkpoint.lora_adapter import LoraBase
from pretrain.config import ModelConfig
from pretrain.data.gpt_dataset import global_batch_indices
from pretrain.distributed.ddp import global_loss_tokens
from pretrain.models.base import ShardedModule
from pretrain.models.forward_context import ForwardContext
from pretrain.models.gpt import GPTModel
from pretrain.models.lora import LoraConfig, add_lora
from pretrain.models.sharding import load_full_state_dict
from pretrain.parallel.state import ParallelState
from pretrain.pipeline.partition import build_model_chunks
from pretrain.pipeline.schedules import forward_backward
from pretrain.tensor_parallel.vocab import padded_vocab_size
from pretrain.training.config import TrainingConfig
from pretrain.training.flops import gpt_flops_per_iteration
from pretrain.training.task import Microbatch
from pretrain.utils.errors import UserError


def sft_forward_step(
    model: ShardedModule, mb: Microbatch, hidden: torch.Tensor | None, is_last: bool
) -> torch.Tensor:
    """GPT stage forward on SFT rows: packed rows get the block-diagonal causal mask and their
    restarting positions; the last stage returns per-token losses ``[b, s]``."""
    segments = mb.get("segments")
    ctx = ForwardContext(attn_mask=None if segments is None else block_causal_mask(segments),
                         position_ids=mb.get("position_ids"))  # fmt: skip
    kwargs: dict[str, Any] = {"hidden_states": hidden} if hidden is not None else {"input_ids": mb["tokens"]}
    if is_last:  # with the loss mask the output layer skips the rows that carry no loss
        kwargs.update(labels=mb["labels"], loss_mask=mb["loss_mask"])
    return model(ctx=ctx, **kwargs)


def epoch_rows(index: int, n: int, global_batch: int, ps: ParallelState, seed: int) -> np.ndarray:
    """This DP rank's rows of training global batch ``index``: an epoch-seeded shuffle of ``n``
    rows, global batches running on into the next epoch (as the other finetuning tasks)."""
    positions = global_batch_indices(index, global_batch, ps.dp_rank, ps.dp_size)
    perms: dict[int, np.ndarray] = {}
    out = []
    for p in positions:
        epoch = int(p) // n
        if epoch not in perms:
            perms[epoch] = np.random.default_rng(seed + 7919 * epoch).permutation(n)
        out.append(perms[epoch][int(p) % n])
    return np.asarray(out, dtype=np.int64)


@dataclass(kw_only=True)
class SFTTask:
    """Training rows, the decoder config and its starting weights (``None``: ``--load`` gives them).

    With ``lora``, every chunk gets adapters after the base weights are loaded (only they train;
    ``adapter`` holds full adapter tensors to start from) and checkpoints hold the adapter with a
    reference to ``lora_base``."""

    model_cfg: ModelConfig
    train_cfg: TrainingConfig
    rows: Rows
    pretrained: Mapping[str, torch.Tensor] | None = None
    model_type: str = "gpt"
    loss_names: tuple[str, ...] = ("lm loss",)
    lora: LoraConfig | None = None
    lora_base: LoraBase | None = None
    adapter: Mapping[str, torch.Tensor] | None = None
    chunks: list[ShardedModule] = field(default_factory=list)

    def build_chunks(self, ps: ParallelState) -> list[ShardedModule]:
        self.chunks = build_model_chunks(self.model_cfg, ps, GPTModel)
        return self.chunks

    def load_initial_weights(self, chunks: list[ShardedModule], ps: ParallelState) -> None:
        """The starting decoder's canonical tensors into every chunk (before the optimizer copies them)."""
        for chunk in chunks:
            try:
                if self.pretrained is not None:
                    load_full_state_dict(chunk, self.pretrained)
                if self.lora is not None:
                    add_lora(chunk, self.lora, seed=self.train_cfg.seed)
                    if self.adapter is not None:
                        load_full_state_dict(chunk, dict(self.adapter), strict=False)
            except (KeyError, ValueError) as exc:
                raise UserError(f"the starting model's weights do not fit its config: {exc}") from None

    def forward_step(
        self, model: ShardedModule, mb: Microbatch, hidden: torch.Tensor | None, is_last: bool
    ) -> torch.Tensor:
        return sft_forward_step(model, mb, hidden, is_last)

    def microbatches(self, split: str, index: int, ps: ParallelState) -> list[Microbatch]:
        t = self.train_cfg
        t.num_microbatches(ps.dp_size)
        rows = epoch_rows(index, len(self.rows["tokens"]), t.global_batch_size, ps, t.seed)
        return rows_to_microbatches(self.rows, rows, t.micro_batch_size, ps.device)

    def normalizers(self, mbs: list[Microbatch], ps: ParallelState) -> dict[str, float]:
        return {"tokens": global_loss_tokens([mb["loss_mask"] for mb in mbs], ps)}

    def loss(
        self, output: torch.Tensor, mb: Microbatch, norms: dict[str, float]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = (output.float() * mb["loss_mask"]).sum() / max(norms["tokens"], 1.0)
        return loss, {"lm loss": loss.detach()}

    def flops_per_iteration(self, global_batch: int) -> float:
        cfg = self.model_cfg
        padded = padded_vocab_size(cfg.vocab_size, tp=1, divisible_by=cfg.make_vocab_size_divisible_by)
        return gpt_flops_per_iteration(cfg, global_batch=global_batch, seq_length=self.train_cfg.seq_length,
                                       padded_vocab=padded)  # fmt: skip


def _replica_rows(n: int, ps: ParallelState) -> tuple[np.ndarray, int]:
    """This DP replica's rows ``r::dp`` of ``n``, and how many are real. With expert parallelism
    every replica runs as many rows (padded with row 0, no loss), so that its forwards, and the
    expert all-to-alls in them, pair with the other replicas'."""
    mine = np.arange(ps.dp_rank, n, ps.dp_size)
    real = len(mine)
    if ps.ep_size > 1:
        mine = np.concatenate([mine, np.zeros(-(-n // ps.dp_size) - real, dtype=mine.dtype)])
    return mine, real


@torch.no_grad()
def valid_loss(
    chunks: list[ShardedModule], ps: ParallelState, rows: Rows, micro_batch: int
) -> tuple[float, int]:
    """``(mean NLL, loss tokens)`` over every row of ``rows`` (dropout off). DP rank ``r`` runs rows
    ``r::dp``; the last stage's TP-rank-0 sums (float64) are all-reduced. Collective over all ranks."""
    mine, real = _replica_rows(len(rows["tokens"]), ps)
    total = torch.zeros(2, dtype=torch.float64)

    def loss_fn(out: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        mask = mb["loss_mask"].double()
        total[0] += float((out.double() * mask).sum())
        total[1] += float(mask.sum())
        return torch.zeros(())

    for c in chunks:
        c.eval()
    try:
        if len(mine):
            mbs = rows_to_microbatches(rows, mine, micro_batch, ps.device)
            for k, mb in enumerate(mbs):  # padding rows (see _replica_rows) carry no loss
                mb["loss_mask"][max(real - k * micro_batch, 0) :] = 0
            forward_backward(chunks=chunks, ps=ps, microbatches=mbs, loss_fn=loss_fn, forward_only=True,
                             forward_step=sft_forward_step)  # fmt: skip
    finally:
        for c in chunks:
            c.train()
    if not (ps.is_last_stage and ps.tp_rank == 0):
        total.zero_()
    if dist.is_initialized() and dist.get_world_size() > 1:
        reduced = total.to(ps.device)
        dist.all_reduce(reduced)
        total = reduced.cpu()
    tokens = int(total[1])
    return float(total[0] / max(tokens, 1)), tokens
