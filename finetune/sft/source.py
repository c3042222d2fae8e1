"""The decoder SFT starts from: ``--ckpt DIR`` (ours or Megatron's, any layout and format) or
``--hf-model DIR`` (a Hugging Face Llama-family or GPT-2 directory, read memory-mapped), with its
tokenizer (the checkpoint's own, or ``--tokenizer-dir`` checked against it) and that tokenizer as a
transformers tokenizer for chat templates. A LoRA checkpoint as ``--ckpt`` is its base (opened from
the path it records, fingerprint checked) plus its adapter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pretrain.checkpoint.lora_adapter import LoraBase
from pretrain.config import ModelConfig
from pretrain.models.lora import LoraConfig
from pretrain.tokenizer.base import Tokenizer
from pretrain.utils.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, kw_only=True)
class Decoder:
    """A starting decoder: config, canonical tensors (maybe lazy), tokenizer and identity."""

    cfg: ModelConfig
    tensors: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str  # the directory given
    fingerprint: str
    iteration: int | None = None
    source_model_type: str | None = None  # a Hugging Face source's model_type (exported back as it)
    lora: LoraConfig | None = None  # a LoRA checkpoint's settings, ``adapter`` its full tensors
    adapter: Mapping[str, torch.Tensor] | None = None
    base: LoraBase | None = None  # the base weights: a LoRA checkpoint's, else these (``base_of``)

    def base_of(self) -> LoraBase:
        """The base weights new LoRA adapters on this decoder belong to."""
        return self.base or LoraBase(path=str(Path(self.source).resolve()), fingerprint=self.fingerprint)

    @property
    def name(self) -> str:
        return Path(self.source).resolve().name


def _from_ckpt(path: str, tokenizer_dir: str | None, force: bool) -> Decoder:
    from mlm_eval.scoring.megatron import TokenizerChoice, read_gpt_checkpoint

    read = read_gpt_checkpoint(
        path, tokenizer_cfg=TokenizerChoice(directory=tokenizer_dir, force=force), purpose="SFT", lazy=True
    )  # lazy: the run keeps the Decoder, and a copy of every base tensor beside the model's would stay
    return Decoder(cfg=read.cfg, tensors=read.full, tokenizer=read.tokenizer, source=path,
                   fingerprint=read.info["fingerprint"], iteration=read.info["iteration"])  # fmt: skip


def _from_hf(path: str, tokenizer_dir: str | None, force: bool) -> Decoder:
    import json

    from finetune.init_from import TrunkTensors
    from pretrain.checkpoint.fingerprint import weights_fingerprint
    from pretrain.tokenizer.loader import check_tokenizer, load_tokenizer_dir
    from tools.hf_io import open_hf

    hf_dir = Path(path)
    if not hf_dir.is_dir():
        raise UserError(f"--hf-model {hf_dir}: not a directory")
    source = open_hf(hf_dir)
    if not source.spec.model_kind.causal_lm:
        raise UserError(
            f"--hf-model {hf_dir}: holds a {source.spec.kind} model; SFT needs a decoder (GPT, Llama family)"
        )
    where, flag = (tokenizer_dir, "--tokenizer-dir") if tokenizer_dir else (path, "--hf-model")
    tok = load_tokenizer_dir(where, flag=flag)
    cfg = source.spec.cfg
    check_tokenizer(tok, what=f"{flag} {where}", model_vocab=cfg.vocab_size, recorded=None,
                    model_source=f"--hf-model {hf_dir}", force=force,
                    divisible_by=cfg.make_vocab_size_divisible_by)  # fmt: skip
    model_type = json.loads((hf_dir / "config.json").read_text(encoding="utf-8")).get("model_type")
    return Decoder(cfg=cfg, tensors=TrunkTensors(source), tokenizer=tok, source=path,
                   fingerprint=weights_fingerprint(source), source_model_type=model_type)  # fmt: skip


def _rehash(path: str, hf: bool, scheme: str) -> str:
    """The fingerprint under ``scheme`` of the base at ``path`` (a LoRA adapter recorded its base
    under an earlier scheme than the one its weights were just hashed with)."""
    from pretrain.checkpoint.fingerprint import weights_fingerprint

    if hf:
        from tools.hf_io import open_hf

        return weights_fingerprint(open_hf(Path(path)), scheme=scheme)
    from pretrain.checkpoint.opener import open_checkpoint

    return weights_fingerprint(open_checkpoint(path), scheme=scheme)


def load_decoder(*, ckpt: str | None, hf_model: str | None, tokenizer_dir: str | None = None,
                 force_tokenizer: bool = False) -> Decoder:  # fmt: skip
    """The decoder of exactly one of ``ckpt`` / ``hf_model`` and its checked tokenizer."""
    if (ckpt is None) == (hf_model is None):
        raise UserError("give exactly one of --ckpt DIR or --hf-model DIR")
    if ckpt is not None:
        from pretrain.checkpoint.lora_adapter import is_lora_checkpoint

        if Path(ckpt).is_dir() and is_lora_checkpoint(ckpt):
            return _from_lora(ckpt, tokenizer_dir, force_tokenizer)
        return _from_ckpt(ckpt, tokenizer_dir, force_tokenizer)
    return _from_hf(str(hf_model), tokenizer_dir, force_tokenizer)


def _from_lora(ckpt: str, tokenizer_dir: str | None, force: bool) -> Decoder:
    """A LoRA checkpoint: its recorded base (a checkpoint or Hugging Face directory), checked by
    fingerprint, with the adapter's settings and tensors."""
    import dataclasses

    from pretrain.checkpoint.lora_adapter import check_base, read_adapter

    adapter = read_adapter(ckpt)
    path = adapter.base.path
    if not Path(path).is_dir():
        raise UserError(f"--ckpt {ckpt}: the LoRA adapter's base {path} is not a directory (moved?)")
    hf = (Path(path) / "config.json").is_file()
    base = _from_hf(path, tokenizer_dir, force) if hf else _from_ckpt(path, tokenizer_dir, force)
    check_base(
        adapter, base.fingerprint, where=f"--ckpt {ckpt}", recompute=lambda scheme: _rehash(path, hf, scheme)
    )
    return dataclasses.replace(
        base, source=ckpt, lora=adapter.lora, adapter=adapter.tensors, base=adapter.base
    )


def hf_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerBase:
    """``tok`` as a transformers tokenizer (the one the chat template is applied with)."""
    from tools.hf_io import hf_tokenizer_of

    return hf_tokenizer_of(tok)
