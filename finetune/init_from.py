"""Where finetuning starts: a BERT checkpoint of ours (any layout) or a local Hugging Face directory.

* ``--ckpt DIR``: any Megatron-layout checkpoint (ours or upstream, any TP/PP/VP, legacy or
  ``torch_dist``) through :func:`pretrain.checkpoint.reader.open_checkpoint`; tensors are read
  lazily (memory-mapped), one full tensor at a time. The tokenizer comes from ``--tokenizer-dir``
  / ``--vocab-file``, else the checkpoint's ``tokenizer/`` directory, else its saved tokenizer
  arguments.
* ``--hf-model DIR``: ``BertModel`` (e.g. sentence-transformers), ``BertForPreTraining`` or
  ``MegatronBertForPreTraining`` weights, with the tokenizer in the same directory.

Only the trunk is taken (embeddings, layers, pooler); masked-LM and sentence-order heads are
dropped. The finetuning head, and the pooler when the source has none, keep their seeded fresh
initial values.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain.config import ModelConfig
from pretrain.models.base import ShardedModule
from pretrain.models.sharding import load_full_state_dict
from pretrain.utils.errors import UserError

log = logging.getLogger(__name__)
TRUNK_PREFIX = "language_model."
POOLER_PREFIX = "language_model.pooler."


class _TrunkTensors(Mapping[str, torch.Tensor]):
    """Canonical trunk tensors of a reader (``names()``/``tensor(name)``), materialised on access."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader
        self._names = [n for n in reader.names() if n.startswith(TRUNK_PREFIX)]
        self._set = set(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._set:
            raise KeyError(name)
        return self._reader.tensor(name)  # type: ignore[no-any-return]

    def __contains__(self, name: object) -> bool:
        return name in self._set

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass(frozen=True, kw_only=True)
class Pretrained:
    """A pretrained BERT trunk: config, canonical tensors (maybe lazy), tokenizer, provenance."""

    cfg: ModelConfig
    tensors: Mapping[str, torch.Tensor]
    tokenizer: Any  # transformers fast tokenizer or tokenizers.Tokenizer (for PairEncoder)
    source: str
    iteration: int | str | None = None
    layout: str | None = None

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


def tokenizer_from_dir(path: str | Path) -> Any:
    """A Hugging Face fast tokenizer from a local directory."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise UserError(f"--tokenizer-dir {path}: not a directory")
    try:
        return AutoTokenizer.from_pretrained(str(path), use_fast=True)
    except Exception as exc:
        if (Path(path) / "tokenizer.json").is_file():  # a bare tokenizers file (saved from --vocab-file)
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        raise UserError(
            f"--tokenizer-dir {path}: cannot load a tokenizer ({type(exc).__name__}: {exc})"
        ) from None


def tokenizer_from_vocab(vocab_file: str | Path, *, lower_case: bool = True) -> Any:
    """A BERT WordPiece tokenizer (``tokenizers.Tokenizer``) from ``vocab.txt``."""
    from tokenizers import BertWordPieceTokenizer

    if not Path(vocab_file).is_file():
        raise UserError(f"--vocab-file {vocab_file}: no such file")
    try:
        wp = BertWordPieceTokenizer(str(vocab_file), lowercase=lower_case)
    except Exception as exc:
        raise UserError(f"--vocab-file {vocab_file}: cannot load a WordPiece vocabulary ({exc})") from None
    return wp._tokenizer


def _tokenizer_from_ckpt(root: Path, args: Mapping[str, Any]) -> Any:
    if (root / "tokenizer").is_dir():
        return tokenizer_from_dir(root / "tokenizer")
    tok = (args.get("mlm_toolkit") or {}).get("tokenizer") or {}
    kind = tok.get("tokenizer_type")
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase") and tok.get("vocab_file"):
        return tokenizer_from_vocab(tok["vocab_file"], lower_case=kind == "BertWordPieceLowerCase")
    if kind == "HuggingFaceTokenizer" and tok.get("model_path"):
        return tokenizer_from_dir(tok["model_path"])
    raise UserError(
        f"--ckpt {root}: no tokenizer recorded in the checkpoint; pass --vocab-file or --tokenizer-dir"
    )


def _vocab_size(tokenizer: Any) -> int:
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    return int(backend.get_vocab_size(with_added_tokens=True))


# --- sources ---------------------------------------------------------------------------------------


def _from_ckpt(path: Path, tokenizer: Any) -> Pretrained:
    from pretrain.checkpoint.reader import open_checkpoint

    if not path.exists():
        raise UserError(f"--ckpt {path}: no such directory")
    reader = open_checkpoint(path)
    if reader.spec.kind != "bert":
        raise UserError(f"--ckpt {path}: holds a {reader.spec.kind} model; finetuning needs a BERT")
    info = getattr(reader, "info", None)
    if tokenizer is None:
        tokenizer = _tokenizer_from_ckpt(path, getattr(reader, "args", {}) or {})
    layout = None if info is None else f"tp{info.tp}-pp{info.pp}-vp{info.vp}"
    return Pretrained(cfg=reader.spec.cfg, tensors=_TrunkTensors(reader), tokenizer=tokenizer,
                      source=str(path), iteration=getattr(info, "iteration", None), layout=layout)  # fmt: skip


def hf_trunk_to_canonical(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical trunk tensors from a HF BERT / MegatronBERT state dict with or without the
    pretraining heads (a bare ``BertModel`` has neither ``bert.`` prefixes nor ``cls.*``)."""
    from pretrain.models.hf_bert import hf_to_canonical

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


def _from_hf(path: Path, tokenizer: Any) -> Pretrained:
    from transformers import AutoConfig

    from pretrain.checkpoint.hf_io import _read_hf_state  # the one HF weight-file reader
    from pretrain.models.hf_bert import model_config_from_hf

    if not (path / "config.json").is_file():
        raise UserError(f"--hf-model {path}: no config.json (not a Hugging Face model directory)")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:
        raise UserError(f"--hf-model {path}: cannot read config.json ({type(exc).__name__}: {exc})") from None
    cfg = model_config_from_hf(config)
    tensors = hf_trunk_to_canonical(_read_hf_state(path), cfg)
    return Pretrained(
        cfg=cfg, tensors=tensors, tokenizer=tokenizer or tokenizer_from_dir(path), source=str(path)
    )


def load_pretrained(
    *, ckpt: str | Path | None = None, hf_model: str | Path | None = None,
    tokenizer_dir: str | Path | None = None, vocab_file: str | Path | None = None, lower_case: bool = True,
) -> Pretrained:  # fmt: skip
    """The pretrained trunk and tokenizer of exactly one of ``ckpt`` / ``hf_model``."""
    if (ckpt is None) == (hf_model is None):
        raise UserError("give exactly one of --ckpt DIR or --hf-model DIR")
    tokenizer = None
    if tokenizer_dir is not None:
        tokenizer = tokenizer_from_dir(tokenizer_dir)
    elif vocab_file is not None:
        tokenizer = tokenizer_from_vocab(vocab_file, lower_case=lower_case)
    pre = _from_ckpt(Path(ckpt), tokenizer) if ckpt is not None else _from_hf(Path(str(hf_model)), tokenizer)
    if _vocab_size(pre.tokenizer) > pre.cfg.vocab_size:
        raise UserError(
            f"the tokenizer has {_vocab_size(pre.tokenizer)} tokens but the model's vocabulary only "
            f"{pre.cfg.vocab_size}; is it the model's tokenizer?"
        )
    return pre
