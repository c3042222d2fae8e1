"""Scoring with our own GPT on checkpoints of any layout (resharded in memory to one process).

``load_megatron_gpt(ckpt, ...)`` reads any Megatron-layout checkpoint the checkpoint tools can
read (ours or upstream, any TP/PP/VP layout and era, ``torch_dist`` too) into canonical full
tensors, builds a single-process :class:`~pretrain.models.gpt.GPTModel`, and wraps it in
:class:`MegatronGPTScorer`. The tokenizer is the checkpoint's own (its ``tokenizer/`` directory,
or the files upstream ``args`` name); tokenizer flags are checked against it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch

from mlm_eval.scoring.scorer import DTYPE_FLAGS, ScoreOutput
from mlm_eval.scoring.vocab import score_hidden, scored_hidden
from pretrain.checkpoint.expert_layout import ExpertShare
from pretrain.checkpoint.fingerprint import combine_digests, tensor_digests
from pretrain.checkpoint.opener import open_checkpoint
from pretrain.checkpoint.types import CheckpointReader, SourceTensors
from pretrain.config import DTypeName, ModelConfig
from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import load_full_state_dict
from pretrain.models.transformer import DTYPES
from pretrain.parallel.state import ParallelState
from pretrain.tokenizer.base import Tokenizer
from pretrain.tokenizer.factory import TokenizerConfig, build_tokenizer
from pretrain.tokenizer.loader import (
    ResolvedTokenizer,
    check_tokenizer,
    load_tokenizer_dir,
    record_of,
    resolve_tokenizer,
)
from pretrain.utils.errors import UserError


class PretrainTextEncoder:
    """:class:`~mlm_eval.scoring.scorer.TextEncoder` over an mlm-toolkit tokenizer (eod as document prefix)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.tokenize(text))

    @property
    def prefix_token_id(self) -> int | None:
        """BOS if the tokenizer has one, else the end-of-document token (lm-eval's ``HFLM`` rule)."""
        bos = self.tokenizer.bos
        return bos if bos is not None else self.tokenizer.eod

    @property
    def adds_bos(self) -> bool:
        return bool(self.tokenizer.adds_bos)

    def __len__(self) -> int:
        return int(self.tokenizer.vocab_size)


class MegatronGPTScorer:
    """:class:`~mlm_eval.scoring.scorer.LMScorer` over our GPT (one process, eval mode, no dropout).

    ``score`` runs rows ``batch_size`` at a time in inference mode: the trunk gives hidden states
    ``[b, s, h]`` (when at most half the columns are scored, its last layer computes queries and
    MLP only at scored positions), and only the rows with a target ``>= 0`` go through the output layer
    (trimmed to the true vocabulary, so padded rows can never win an argmax or take mass).
    Trailing columns no row scores are cut before the forward (causal: they cannot matter).
    """

    def __init__(self, model: GPTModel, *, batch_size: int = 8) -> None:
        self.model = model.eval()
        self.batch_size = batch_size
        self.max_length = model.cfg.max_position_embeddings
        self.vocab_size = model.cfg.vocab_size

    @torch.inference_mode()
    def score(self, input_ids: torch.Tensor, target_ids: torch.Tensor) -> ScoreOutput:
        """Score each non-negative target; see :class:`~mlm_eval.scoring.scorer.LMScorer`."""
        if input_ids.shape != target_ids.shape or input_ids.ndim != 2:
            raise ValueError(f"input {tuple(input_ids.shape)} and target {tuple(target_ids.shape)} differ")
        nll = torch.zeros(target_ids.shape, dtype=torch.float64)
        hit = torch.zeros(target_ids.shape, dtype=torch.bool)
        device = self.model.ps.device
        for lo in range(0, input_ids.shape[0], self.batch_size):
            tgt = target_ids[lo : lo + self.batch_size]
            width = scored_width(tgt)
            if width == 0:
                continue
            ids, tgt = input_ids[lo : lo + self.batch_size, :width], tgt[:, :width]
            mask = tgt >= 0
            hidden = scored_hidden(self.model, mask.to(device), input_ids=ids.to(device))
            out = score_hidden(self.model, hidden, tgt[mask].to(device))
            nll[lo : lo + len(tgt), :width][mask] = out.nll.cpu()
            hit[lo : lo + len(tgt), :width][mask] = out.is_argmax.cpu()
        return ScoreOutput(nll=nll, is_argmax=hit)


def scored_width(target_ids: torch.Tensor) -> int:
    """1 + the last column of ``target_ids [b, s]`` holding a scored (``>= 0``) target, or 0."""
    cols = (target_ids >= 0).any(dim=0).nonzero()
    return int(cols[-1]) + 1 if cols.numel() else 0


def eval_model_config(cfg: ModelConfig, dtype: DTypeName | str) -> ModelConfig:
    """``cfg`` for evaluation: no dropout, no recompute, no sequence parallelism, parameters in ``dtype`` (a DTYPES name)."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: expected one of {', '.join(DTYPE_FLAGS)}")
    return replace(
        cfg,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        recompute_activations=False,
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
        sequence_parallel=False,
        params_dtype=cast(DTypeName, dtype),
    )


@dataclass(frozen=True, kw_only=True)
class TokenizerChoice:
    """The tokenizer flags of an evaluation: Megatron's (``--tokenizer-type`` and files) or a
    directory (``--tokenizer-dir``), and ``--force-tokenizer``. None given: the checkpoint's own."""

    megatron: TokenizerConfig | None = None
    directory: str | None = None
    force: bool = False


def _open_with_tokenizer(
    ckpt: str, choice: TokenizerChoice, experts: ExpertShare | None = None
) -> tuple[CheckpointReader, ResolvedTokenizer]:
    """The opened checkpoint and its checked tokenizer (see ``pretrain.tokenizer.loader``); where
    the checkpoint does not record its vocabulary, the tokenizer's size tells it (a view, not a reopen)."""
    reader = open_checkpoint(ckpt, experts=experts)
    if choice.megatron is not None:
        tok = build_tokenizer(choice.megatron)
        what = f"--tokenizer-type {choice.megatron.tokenizer_type}"
    elif choice.directory is not None:
        tok = load_tokenizer_dir(choice.directory)
        what = f"--tokenizer-dir {choice.directory}"
    else:
        resolved = resolve_tokenizer(reader, required=True, force=choice.force)
        assert resolved is not None
        if not reader.info.vocab_known:
            reader = reader.with_vocab(resolved.tokenizer.vocab_size, source=resolved.source)
        return reader, resolved
    if not reader.info.vocab_known:  # the flag's tokenizer tells the true vocabulary
        reader = reader.with_vocab(tok.vocab_size, source=what)
    meta = reader.metadata
    forced = check_tokenizer(tok, what=what, model_vocab=reader.spec.cfg.vocab_size,
                             recorded=None if meta is None else meta.tokenizer,
                             model_source=f"--ckpt {ckpt}", force=choice.force,
                             divisible_by=reader.spec.cfg.make_vocab_size_divisible_by)  # fmt: skip
    return reader, ResolvedTokenizer(tokenizer=tok, source=what, record=record_of(tok), forced=tuple(forced))


@dataclass(frozen=True, kw_only=True)
class CanonicalGPT:
    """A GPT checkpoint read into canonical full tensors, with its tokenizer and identity."""

    full: Mapping[str, torch.Tensor]  # a dict, or (``lazy``) read from the checkpoint on access
    cfg: ModelConfig  # the checkpoint's model config (training dropout etc. as saved)
    tokenizer: Tokenizer
    info: dict[str, Any]  # the result record's "model": name, parameters, iteration, layout, checkpoint
    digests: dict[str, bytes]  # each read tensor's fingerprint digest (an expert share's: combine over ranks)


def read_gpt_checkpoint(
    ckpt: str,
    *,
    tokenizer_cfg: TokenizerChoice | TokenizerConfig | None = None,
    purpose: str = "zero-shot LM evaluation",
    experts: ExpertShare | None = None,
    lazy: bool = False,
) -> CanonicalGPT:
    """Read ``ckpt`` (any layout the checkpoint tools read) and its tokenizer; no model is built.

    ``lazy``: :attr:`CanonicalGPT.full` re-reads each tensor from the checkpoint when it is
    accessed instead of holding a copy of every tensor (a caller that keeps the result for a whole
    run, such as SFT, then holds no second copy of the weights beside the model's).

    The tokenizer is the checkpoint's own unless flags name one, which is then checked against it
    (vocabulary, special ids, probe encoding; ``force`` overrides and ``info["tokenizer"]`` says so).
    ``experts``: read only that expert-parallel share's routed experts; ``info["fingerprint"]`` is
    then ``None`` (the ranks' :attr:`CanonicalGPT.digests` together give it).
    """
    if not Path(ckpt).exists():
        raise UserError(f"--ckpt {ckpt}: no such directory")
    choice = (
        tokenizer_cfg
        if isinstance(tokenizer_cfg, TokenizerChoice)
        else TokenizerChoice(megatron=tokenizer_cfg)
    )
    reader, resolved = _open_with_tokenizer(ckpt, choice, experts)
    spec, info = reader.spec, reader.info
    if not spec.model_kind.causal_lm:
        raise UserError(f"--ckpt {ckpt}: holds a {spec.kind} model; {purpose} needs a GPT")
    if not info.vocab_known:
        raise UserError(f"--ckpt {ckpt}: the true vocabulary size is unknown ({info.vocab_source})")
    names = [n for n in reader.names() if experts is None or experts.keeps(n, spec.cfg.num_experts)]
    full: Mapping[str, torch.Tensor]
    if lazy:
        full = SourceTensors(reader, names)
        digests = tensor_digests(
            ((name, reader.tensor(name)) for name in names), vocab_size=spec.cfg.vocab_size
        )
    else:
        full = {name: reader.tensor(name).clone() for name in names}
        digests = tensor_digests(full.items(), vocab_size=spec.cfg.vocab_size)
    tokenizer = resolved.tokenizer
    meta = {
        "name": Path(ckpt).resolve().name,
        "parameters": info.num_parameters,
        "iteration": info.iteration if isinstance(info.iteration, int) else None,
        "layout": f"tp{info.tp}-pp{info.pp}-vp{info.vp}",
        "checkpoint": os.fspath(Path(ckpt).resolve()),
        # The weights' identity across layouts and formats (the leaderboard's row key).
        "fingerprint": combine_digests(digests) if experts is None else None,
        "tokenizer": {
            "source": resolved.source,
            "type": tokenizer.tokenizer_type,
            "forced": list(resolved.forced),
        },
    }
    return CanonicalGPT(full=full, cfg=spec.cfg, tokenizer=tokenizer, info=meta, digests=digests)


def load_megatron_gpt(
    ckpt: str,
    *,
    tokenizer_cfg: TokenizerChoice | TokenizerConfig | None,
    batch_size: int,
    device: str = "cpu",
    dtype: str = "float32",
) -> tuple[MegatronGPTScorer, PretrainTextEncoder, dict[str, Any]]:
    """Scorer (one process, parameters in ``dtype``), text encoder and model info for ``ckpt``."""
    read = read_gpt_checkpoint(ckpt, tokenizer_cfg=tokenizer_cfg)
    model = GPTModel(eval_model_config(read.cfg, dtype), ParallelState.single(device=device))
    load_full_state_dict(model, read.full)
    return MegatronGPTScorer(model, batch_size=batch_size), PretrainTextEncoder(read.tokenizer), read.info
