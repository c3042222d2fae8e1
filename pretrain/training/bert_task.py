"""BERT pretraining (masked LM + sentence-order prediction) as a :class:`TrainTask`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pretrain.config import ModelConfig
from pretrain.data.bert_dataset import BertDataset, BertDatasetConfig
from pretrain.data.gpt_dataset import (
    GPTDatasetConfig,
    split_document_ranges,
)
from pretrain.data.indexed_dataset import IndexedDataset
from pretrain.data.masking import BertVocab
from pretrain.models.base import ShardedModule
from pretrain.models.bert import bert_forward_step, bert_loss_terms, bert_model_provider
from pretrain.parallel.state import ParallelState
from pretrain.pipeline.partition import build_model_chunks
from pretrain.tensor_parallel.vocab import padded_vocab_size
from pretrain.tokenizer.base import Tokenizer
from pretrain.training.config import TrainingConfig
from pretrain.training.flops import gpt_flops_per_iteration
from pretrain.training.run_configs import PretrainConfigs
from pretrain.training.task import Microbatch, dp_microbatches
from pretrain.utils.errors import UserError

SPLITS = ("train", "valid", "test")


@dataclass(kw_only=True)
class BertTask:
    """MLM loss averaged over the masked tokens of the global batch + SOP loss over its samples."""

    model_cfg: ModelConfig
    data_cfg: GPTDatasetConfig  # data prefix, split, seed and cache dir (shared with GPT)
    train_cfg: TrainingConfig
    tokenizer: Tokenizer
    model_type: str = "bert"
    loss_names: tuple[str, ...] = ("lm loss", "sop loss")
    datasets: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_configs(cls, cfgs: PretrainConfigs) -> BertTask:
        if len(cfgs.data.data_prefix) != 1:
            raise UserError("mlm-pretrain bert takes one --data-path prefix (a sentence-split dataset)")
        return cls(
            model_cfg=cfgs.model,
            data_cfg=cfgs.data,
            train_cfg=cfgs.train,
            tokenizer=cfgs.tokenizer,
        )

    def build_chunks(self, ps: ParallelState) -> list[ShardedModule]:
        return build_model_chunks(self.model_cfg, ps, bert_model_provider(add_binary_head=True))

    def forward_step(
        self, model: ShardedModule, mb: Microbatch, hidden: torch.Tensor | None, is_last: bool
    ) -> Any:
        return bert_forward_step(model, mb, hidden, is_last)

    def _build(self) -> None:
        t = self.train_cfg
        indexed = IndexedDataset(self.data_cfg.data_prefix[0])
        ranges = split_document_ranges(self.data_cfg.split, indexed.num_documents)
        evals = (t.train_iters // t.eval_interval + 1) * t.eval_iters if t.eval_interval else 0
        wanted = [t.train_iters * t.global_batch_size, evals * t.global_batch_size, 0]
        cfg = BertDatasetConfig(
            seq_length=t.seq_length, seed=self.data_cfg.seed, cache_dir=self.data_cfg.cache_dir
        )
        vocab = BertVocab.from_tokenizer(self.tokenizer)
        for name, (lo, hi), n in zip(SPLITS, ranges, wanted, strict=True):
            docs = torch.arange(lo, hi).numpy()
            self.datasets[name] = (
                BertDataset(indexed, cfg, vocab, documents=docs, num_samples=n, split=name)
                if n and hi > lo
                else None
            )

    def microbatches(self, split: str, index: int, ps: ParallelState) -> list[Microbatch]:
        if not self.datasets:
            self._build()
        ds = self.datasets.get(split)
        if ds is None:
            raise UserError(f"--split {self.data_cfg.split} leaves no {split} documents in --data-path")
        return dp_microbatches(ds, index, self.train_cfg, ps)

    def normalizers(self, mbs: list[Microbatch], ps: ParallelState) -> dict[str, float]:
        counts = torch.tensor(
            [
                sum(float(mb["loss_mask"].sum()) for mb in mbs),
                float(sum(mb["tokens"].shape[0] for mb in mbs)),
            ],
            dtype=torch.float64,
        )
        if ps.dp_group is not None:
            dist.all_reduce(counts, group=ps.dp_group)
        return {"masked": max(float(counts[0]), 1.0), "samples": float(counts[1])}

    def loss(
        self, output: Any, mb: Microbatch, norms: dict[str, float]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mlm_sum, sop_sum = bert_loss_terms(output, mb)
        lm = mlm_sum / norms["masked"]
        sop = sop_sum / norms["samples"] if sop_sum is not None else torch.zeros((), dtype=lm.dtype)
        return lm + sop, {"lm loss": lm.detach(), "sop loss": sop.detach()}

    def flops_per_iteration(self, global_batch: int) -> float:
        padded = padded_vocab_size(
            self.model_cfg.vocab_size, tp=1, divisible_by=self.model_cfg.make_vocab_size_divisible_by
        )
        return gpt_flops_per_iteration(self.model_cfg, global_batch=global_batch, seq_length=self.train_cfg.seq_length,
                                       padded_vocab=padded)  # fmt: skip
