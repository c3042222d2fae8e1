"""Scoring with our own GPT on checkpoints of any layout (resharded in memory to one process).

``load_megatron_gpt(ckpt, ...)`` reads any Megatron-layout checkpoint the checkpoint tools can
read (ours or upstream, any TP/PP/VP layout and era, ``torch_dist`` too) into canonical full
tensors, builds a single-process :class:`~pretrain.models.gpt.GPTModel`, and wraps it in
:class:`MegatronGPTScorer`. The tokenizer comes from the Megatron tokenizer flags, or from the
tokenizer configuration our checkpoints store when none are given.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mlm_eval.scorer import ScoreOutput, nll_and_argmax
from pretrain.checkpoint.reader import load_canonical
from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import load_full_state_dict
from pretrain.parallel.state import ParallelState
from pretrain.tokenizer.base import Tokenizer
from pretrain.tokenizer.factory import TokenizerConfig, build_tokenizer
from pretrain.utils.errors import UserError


class PretrainTextEncoder:
    """:class:`~mlm_eval.scorer.TextEncoder` over an mlm-toolkit tokenizer (eod as document prefix)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.tokenize(text))

    @property
    def prefix_token_id(self) -> int | None:
        return self.tokenizer.eod

    def __len__(self) -> int:
        return int(self.tokenizer.vocab_size)


class MegatronGPTScorer:
    """:class:`~mlm_eval.scorer.LMScorer` over our GPT (one process, eval mode, no dropout).

    ``score`` runs rows ``batch_size`` at a time; logits ``[b, s, V]`` exclude vocabulary padding,
    so padded rows can never win an argmax or take probability mass.
    """

    def __init__(self, model: GPTModel, *, batch_size: int = 8) -> None:
        self.model = model.eval()
        self.batch_size = batch_size
        self.max_length = model.cfg.max_position_embeddings
        self.vocab_size = model.cfg.vocab_size

    @torch.inference_mode()
    def score(self, input_ids: torch.Tensor, target_ids: torch.Tensor) -> ScoreOutput:
        nll, hit = [], []
        for lo in range(0, input_ids.shape[0], self.batch_size):
            ids, tgt = input_ids[lo : lo + self.batch_size], target_ids[lo : lo + self.batch_size]
            logits = self.model.full_logits(self.model(ids))
            out = nll_and_argmax(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), self.vocab_size)
            nll.append(out.nll.view(tgt.shape))
            hit.append(out.is_argmax.view(tgt.shape))
        return ScoreOutput(nll=torch.cat(nll), is_argmax=torch.cat(hit))


def _tokenizer(args_tok: TokenizerConfig | None, saved: dict[str, Any] | None, ckpt: str) -> Tokenizer:
    if args_tok is not None:
        return build_tokenizer(args_tok)
    if not saved:
        raise UserError(
            f"--ckpt {ckpt}: the checkpoint stores no tokenizer; give --tokenizer-type and its files"
        )
    return build_tokenizer(
        TokenizerConfig(
            **{k: saved.get(k) for k in ("tokenizer_type", "vocab_file", "merge_file", "model_path")}
        )
    )


def load_megatron_gpt(
    ckpt: str, *, tokenizer_cfg: TokenizerConfig | None, batch_size: int, device: str = "cpu"
) -> tuple[MegatronGPTScorer, PretrainTextEncoder, dict[str, Any]]:
    """Scorer, text encoder and result-record model info for checkpoint ``ckpt``."""
    if not Path(ckpt).exists():
        raise UserError(f"--ckpt {ckpt}: no such directory")
    full, spec, info = load_canonical(ckpt)
    if spec.kind != "gpt":
        raise UserError(f"--ckpt {ckpt}: holds a {spec.kind} model; zero-shot LM evaluation needs a GPT")
    saved_tok = _saved_tokenizer(ckpt)
    tokenizer = _tokenizer(tokenizer_cfg, saved_tok, ckpt)
    if tokenizer.vocab_size > info.padded_vocab_size:
        raise UserError(
            f"tokenizer has {tokenizer.vocab_size} tokens but --ckpt {ckpt} only {info.padded_vocab_size}"
        )
    cfg = replace(spec.cfg, hidden_dropout=0.0, attention_dropout=0.0, recompute_activations=False)
    model = GPTModel(cfg, ParallelState.single(device=device))
    load_full_state_dict(model, full)
    meta = {
        "name": Path(ckpt).resolve().name,
        "parameters": info.num_parameters,
        "iteration": info.iteration if isinstance(info.iteration, int) else None,
        "layout": f"tp{info.tp}-pp{info.pp}-vp{info.vp}",
        "checkpoint": os.fspath(Path(ckpt).resolve()),
    }
    return MegatronGPTScorer(model, batch_size=batch_size), PretrainTextEncoder(tokenizer), meta


def _saved_tokenizer(ckpt: str) -> dict[str, Any] | None:
    """The tokenizer config our checkpoints keep in ``args.mlm_toolkit.tokenizer`` (None otherwise)."""
    from pretrain.checkpoint.reader import open_checkpoint

    args = getattr(open_checkpoint(ckpt), "args", None)
    args = args() if callable(args) else args
    tok = (args or {}).get("mlm_toolkit", {}).get("tokenizer") if isinstance(args, dict) else None
    return tok if isinstance(tok, dict) else None
