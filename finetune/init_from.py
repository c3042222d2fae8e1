"""Where finetuning starts: a BERT checkpoint of ours (any layout) or a local Hugging Face directory.

* ``--ckpt DIR``: any Megatron-layout checkpoint (ours or upstream, any TP/PP/VP, legacy or
  ``torch_dist``) through :func:`pretrain.checkpoint.opener.open_checkpoint`; tensors are read
  lazily (memory-mapped), one full tensor at a time. The tokenizer is the checkpoint's own
  (``tokenizer/``, or the files its args name); ``--tokenizer-dir`` / ``--vocab-file`` are checked
  against it (``--force-tokenizer`` overrides).
* ``--hf-model DIR``: ``BertModel`` (e.g. sentence-transformers), ``BertForPreTraining`` or
  ``MegatronBertForPreTraining`` weights, with the tokenizer in the same directory (a directory
  without one is refused unless ``--tokenizer-dir`` / ``--vocab-file`` is given).

Only the trunk is taken (embeddings, layers, pooler); masked-LM and sentence-order heads are
dropped. The finetuning head, and the pooler when the source has none, keep their seeded fresh
initial values.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint.fingerprint import fingerprint_tensors
from pretrain.checkpoint.types import SourceTensors, TensorSource
from pretrain.config import ModelConfig
from pretrain.models.base import ShardedModule
from pretrain.models.sharding import load_full_state_dict
from pretrain.tokenizer.base import Tokenizer
from pretrain.utils.errors import UserError

log = logging.getLogger(__name__)
TRUNK_PREFIX = "language_model."
POOLER_PREFIX = "language_model.pooler."


class TrunkTensors(SourceTensors):
    """Canonical ``language_model.*`` tensors of a reader, read on access: a BERT trunk, or every
    tensor of a GPT (SFT)."""

    def __init__(self, reader: TensorSource) -> None:
        super().__init__(reader, [n for n in reader.names() if n.startswith(TRUNK_PREFIX)])


@dataclass(frozen=True, kw_only=True)
class Pretrained:
    """A pretrained BERT trunk: config, canonical tensors (maybe lazy), tokenizer, provenance."""

    cfg: ModelConfig
    tensors: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer  # the same objects as pretraining (PairEncoder uses its backend_tokenizer)
    source: str
    iteration: int | str | None = None
    layout: str | None = None
    # known without hashing ``tensors`` (--eval-only: recorded by the finetuning run) / the name
    # results carry (default: ``source``'s directory name)
    fingerprint: str | None = None
    name: str | None = None

    def weights_fingerprint(self) -> str | None:
        """The pretrained weights' fingerprint (``None`` when neither recorded nor readable)."""
        if self.fingerprint is not None:
            return self.fingerprint
        if not len(self.tensors):
            return None
        return fingerprint_tensors(self.tensors.items(), vocab_size=self.cfg.vocab_size)

    def with_config(self, **changes: Any) -> Pretrained:
        """The same weights under a config with ``changes`` (e.g. dropout, params_dtype)."""
        return dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, **changes))


def load_trunk(model: ShardedModule, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Copy the pretrained trunk into one model chunk; returns the canonical names left fresh
    (head, and the pooler when the source has none). Raises :class:`UserError` when a trunk tensor
    is missing. No communication."""
    fresh = []
    for name, _ in model.named_parameters():
        key = model.canonical_name(name)
        if key in tensors:
            continue
        if key.startswith(TRUNK_PREFIX) and not key.startswith(POOLER_PREFIX):
            raise UserError(f"pretrained model has no tensor {key!r}; is it a BERT of this shape?")
        fresh.append(key)
    try:
        load_full_state_dict(model, tensors, strict=False)  # type: ignore[arg-type]
    except ValueError as exc:
        raise UserError(f"pretrained weights do not fit the model: {exc}") from None
    return fresh


# --- tokenizers ------------------------------------------------------------------------------------


def tokenizer_from_dir(path: str | Path, *, flag: str = "--tokenizer-dir") -> Tokenizer:
    """The tokenizer in a local directory (the one loader, :mod:`pretrain.tokenizer.loader`)."""
    from pretrain.tokenizer.loader import load_tokenizer_dir

    return load_tokenizer_dir(path, flag=flag)


def tokenizer_from_vocab(vocab_file: str | Path, *, lower_case: bool = True) -> Tokenizer:
    """A BERT WordPiece tokenizer from ``vocab.txt`` (Megatron's ``BertWordPiece*``)."""
    from pretrain.tokenizer.factory import TokenizerConfig, build_tokenizer

    kind = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
    return build_tokenizer(TokenizerConfig(kind, vocab_file=str(vocab_file)))


# --- sources ---------------------------------------------------------------------------------------


def _from_ckpt(path: Path, tokenizer: Tokenizer | None, force: bool) -> Pretrained:
    from pretrain.checkpoint.opener import open_checkpoint
    from pretrain.tokenizer.loader import check_tokenizer, resolve_tokenizer

    if not path.exists():
        raise UserError(f"--ckpt {path}: no such directory")
    reader = open_checkpoint(path)
    if not reader.spec.model_kind.has_binary_head:  # the BERT encoder finetuning builds on
        raise UserError(f"--ckpt {path}: holds a {reader.spec.kind} model; finetuning needs a BERT")
    info = getattr(reader, "info", None)
    if tokenizer is None:
        resolved = resolve_tokenizer(reader, required=True)
        assert resolved is not None
        tokenizer = resolved.tokenizer
    else:
        meta = reader.metadata
        check_tokenizer(tokenizer, what="the given tokenizer", model_vocab=reader.spec.cfg.vocab_size,
                        recorded=None if meta is None else meta.tokenizer, model_source=f"--ckpt {path}",
                        force=force)  # fmt: skip
    layout = None if info is None else f"tp{info.tp}-pp{info.pp}-vp{info.vp}"
    return Pretrained(cfg=reader.spec.cfg, tensors=TrunkTensors(reader), tokenizer=tokenizer,
                      source=str(path), iteration=getattr(info, "iteration", None), layout=layout)  # fmt: skip


def hf_trunk_to_canonical(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical trunk tensors from a HF BERT / MegatronBERT state dict with or without the
    pretraining heads (a bare ``BertModel`` has neither ``bert.`` prefixes nor ``cls.*``)."""
    from pretrain.models.families.bert import hf_to_canonical

    hf = dict(state)
    if not any(k.startswith("bert.") for k in hf):
        hf = {f"bert.{k}": v for k, v in hf.items()}
    h = cfg.hidden_size
    fill = {  # placeholders for absent pretraining heads (dropped again below)
        "cls.predictions.transform.dense.weight": torch.zeros(h, h),
        "cls.predictions.transform.dense.bias": torch.zeros(h),
        "cls.predictions.transform.LayerNorm.weight": torch.ones(h),
        "cls.predictions.transform.LayerNorm.bias": torch.zeros(h),
        "cls.predictions.bias": torch.zeros(cfg.vocab_size),
    }
    if "bert.pooler.dense.weight" in hf:
        fill.update(
            {"cls.seq_relationship.weight": torch.zeros(2, h), "cls.seq_relationship.bias": torch.zeros(2)}
        )
    for key, value in fill.items():
        hf.setdefault(key, value)
    full = hf_to_canonical(hf, cfg)
    return {k: v for k, v in full.items() if k.startswith(TRUNK_PREFIX)}


def _from_hf(path: Path, tokenizer: Tokenizer | None) -> Pretrained:
    from pretrain.models.families.bert import model_config_from_hf
    from tools.hf_config_json import load_hf_config
    from tools.hf_io import read_hf_state  # the one HF weight-file reader

    if not (path / "config.json").is_file():
        raise UserError(f"--hf-model {path}: no config.json (not a Hugging Face model directory)")
    config: Any = load_hf_config(path, flag="--hf-model")
    cfg = model_config_from_hf(config)
    tensors = hf_trunk_to_canonical(read_hf_state(path), cfg)
    tokenizer = tokenizer or tokenizer_from_dir(path, flag="--hf-model")  # none there: refused
    return Pretrained(cfg=cfg, tensors=tensors, tokenizer=tokenizer, source=str(path))


def load_pretrained(
    *, ckpt: str | Path | None = None, hf_model: str | Path | None = None,
    tokenizer_dir: str | Path | None = None, vocab_file: str | Path | None = None, lower_case: bool = True,
    force_tokenizer: bool = False,
) -> Pretrained:  # fmt: skip
    """The pretrained trunk and tokenizer of exactly one of ``ckpt`` / ``hf_model``."""
    if (ckpt is None) == (hf_model is None):
        raise UserError("give exactly one of --ckpt DIR or --hf-model DIR")
    tokenizer = None
    if tokenizer_dir is not None:
        tokenizer = tokenizer_from_dir(tokenizer_dir)
    elif vocab_file is not None:
        tokenizer = tokenizer_from_vocab(vocab_file, lower_case=lower_case)
    if ckpt is not None:
        pre = _from_ckpt(Path(ckpt), tokenizer, force_tokenizer)
    else:
        pre = _from_hf(Path(str(hf_model)), tokenizer)
    if pre.tokenizer.vocab_size > pre.cfg.vocab_size:
        raise UserError(
            f"the tokenizer has {pre.tokenizer.vocab_size} tokens but the model's vocabulary only "
            f"{pre.cfg.vocab_size}; is it the model's tokenizer?"
        )
    return pre
