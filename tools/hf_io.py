"""Hugging Face directories <-> canonical full tensors (GPT-2 and BERT), written atomically.

:func:`export_hf` writes ``model.safetensors``, ``config.json`` and the tokenizer files of a
checkpoint (GPT -> ``GPT2LMHeadModel``; pre-LN BERT -> ``MegatronBertForPreTraining``; post-LN
BERT -> ``BertForPreTraining``; a checkpoint imported from a bare ``BertModel`` -> ``BertModel``
again, its freshly initialised heads left out). :func:`import_hf` reads a local HF model directory into a
:class:`~pretrain.checkpoint.reshard.DictSource` ready to be written at any layout.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint.plan import ModelSpec
from pretrain.checkpoint.reshard import DictSource
from pretrain.models.sharding import is_vocab_tensor
from pretrain.utils.atomic import atomic_directory
from pretrain.utils.errors import UserError

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "tokenizer.model",
)  # fmt: skip
TOKENIZER_SUBDIR = "tokenizer"  # where from-hf keeps the tokenizer inside our checkpoints


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer files of ``src`` into ``dst``; returns the names copied."""
    names = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    if not names:
        raise UserError(f"--tokenizer-dir {src}: no tokenizer files ({', '.join(TOKENIZER_FILES[:6])}, ...)")
    dst.mkdir(parents=True, exist_ok=True)
    for n in names:
        shutil.copyfile(src / n, dst / n)
    return names


def load_hf_tokenizer(path: Path | None) -> Any:
    """A HF tokenizer from ``path``: a HF tokenizer directory, or Megatron's tokenizer files
    (``vocab.json`` + ``merges.txt`` for GPT-2 BPE, ``vocab.txt`` for WordPiece)."""
    if path is None:
        return None
    from transformers import AutoTokenizer, BertTokenizerFast, GPT2TokenizerFast  # type: ignore[attr-defined]

    try:
        if not (path / "tokenizer.json").is_file() and (path / "merges.txt").is_file():
            return GPT2TokenizerFast.from_pretrained(str(path))
        if not (path / "tokenizer.json").is_file() and (path / "vocab.txt").is_file():
            return BertTokenizerFast.from_pretrained(str(path))
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise UserError(
            f"--tokenizer-dir {path}: cannot load a tokenizer ({type(exc).__name__}: {exc})"
        ) from None


def _trim_vocab(full: dict[str, torch.Tensor], spec: ModelSpec, vocab: int) -> ModelSpec:
    if vocab > spec.cfg.vocab_size:
        raise UserError(f"the tokenizer has {vocab} tokens but the checkpoint only {spec.cfg.vocab_size}")
    for name in [n for n in full if is_vocab_tensor(n)]:
        full[name] = full[name][:vocab]
    return dataclasses.replace(spec, cfg=dataclasses.replace(spec.cfg, vocab_size=vocab))


def hf_state_and_config(
    full: dict[str, torch.Tensor], spec: ModelSpec, tokenizer: Any = None
) -> tuple[dict[str, torch.Tensor], Any]:
    """The HF state dict (tied copies omitted) and ``PretrainedConfig`` of canonical tensors."""
    if spec.kind == "gpt":
        from transformers import GPT2Config

        from pretrain.models import hf_gpt2

        eos = getattr(tokenizer, "eos_token_id", None)
        bos = getattr(tokenizer, "bos_token_id", None)
        kw = hf_gpt2.hf_config_kwargs(spec.cfg, bos_token_id=bos, eos_token_id=eos)
        return hf_gpt2.canonical_to_hf(full, spec.cfg), GPT2Config(**kw)
    from transformers import BertConfig, MegatronBertConfig

    from pretrain.models import hf_bert

    arch = hf_bert.hf_architecture(spec.cfg, bare="lm_head" in spec.fresh_heads)
    config_cls = BertConfig if spec.cfg.post_layernorm else MegatronBertConfig
    extra = {} if tokenizer is None else {"pad_token_id": tokenizer.pad_token_id}
    config = config_cls(**hf_bert.hf_config_kwargs(spec.cfg), architectures=[arch], **extra)
    state = hf_bert.canonical_to_hf(full, spec.cfg, include_tied=False, fresh_heads=spec.fresh_heads)
    return state, config


def export_hf(
    tensors: Iterable[tuple[str, torch.Tensor]],
    spec: ModelSpec,
    save: Path,
    *,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Write a HF model directory at ``save`` (atomically) from canonical ``tensors``."""
    from safetensors.torch import save_file

    full = {name: t.clone() for name, t in tensors}
    tokenizer = load_hf_tokenizer(tokenizer_dir)
    if tokenizer is not None:
        spec = _trim_vocab(full, spec, len(tokenizer))
    state, config = hf_state_and_config(full, spec, tokenizer)
    del full
    with atomic_directory(save) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))
        if tokenizer_dir is not None:
            copy_tokenizer(tokenizer_dir, tmp)
            tokenizer.save_pretrained(str(tmp))  # tokenizer.json + config, loadable by AutoTokenizer
    return save


def _read_hf_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (hf_dir / "model.safetensors").is_file():
        return load_file(str(hf_dir / "model.safetensors"))
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(hf_dir / f)))
        return out
    if (hf_dir / "pytorch_model.bin").is_file():
        return torch.load(hf_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise UserError(f"--load {hf_dir}: no model.safetensors, safetensors index or pytorch_model.bin")


def import_hf(hf_dir: Path, *, make_vocab_size_divisible_by: int = 128) -> DictSource:
    """A local HF GPT-2 / BERT / MegatronBERT directory -> canonical tensors and model spec."""
    from transformers import AutoConfig

    if not (hf_dir / "config.json").is_file():
        raise UserError(f"--load {hf_dir}: no config.json (not a Hugging Face model directory)")
    try:
        config = AutoConfig.from_pretrained(str(hf_dir))
    except Exception as exc:
        raise UserError(f"--load {hf_dir}: cannot read config.json ({type(exc).__name__}: {exc})") from None
    state = _read_hf_state(hf_dir)
    over = {"make_vocab_size_divisible_by": make_vocab_size_divisible_by}
    if config.model_type == "gpt2":
        from pretrain.models import hf_gpt2

        cfg = hf_gpt2.model_config_from_hf(config, **over)
        return DictSource(ModelSpec(kind="gpt", cfg=cfg), hf_gpt2.hf_to_canonical(state, cfg))
    if config.model_type in ("bert", "megatron-bert"):
        from pretrain.models import hf_bert

        cfg = hf_bert.model_config_from_hf(config, **over)
        if not any(k.startswith("bert.") for k in state):  # a bare BertModel / MegatronBertModel
            state = {f"bert.{k}": v for k, v in state.items()}
        bare = not any(k.startswith("cls.") for k in state)
        full = hf_bert.hf_to_canonical(state, cfg, lm_head=not bare)
        fresh = hf_bert.add_fresh_heads(full, cfg)  # our BertModel always has an LM head
        binary = "binary_head.weight" in full
        return DictSource(ModelSpec(kind="bert", cfg=cfg, add_binary_head=binary, fresh_heads=fresh), full)
    raise UserError(f"--load {hf_dir}: model_type {config.model_type!r} is not gpt2, bert or megatron-bert")
