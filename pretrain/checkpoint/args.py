"""Build the typed :class:`~pretrain.checkpoint.types.CheckpointMetadata` of a checkpoint to write.

The record becomes the Megatron-named ``args`` Namespace when a file is written
(:func:`pretrain.checkpoint.metadata.to_args`); :func:`model_config_from_args` and
:func:`parallel_config_from_args` are thin readers kept for existing callers.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from importlib import metadata as _dist

from pretrain.checkpoint.metadata import parallel_of, require_metadata, to_args
from pretrain.checkpoint.types import CheckpointMetadata, FinetuneRecord, Provenance, TokenizerRecord
from pretrain.config import ModelConfig
from pretrain.models.kinds import kind_of
from pretrain.parallel.config import ParallelConfig
from pretrain.tokenizer.base import Tokenizer
from pretrain.tokenizer.loader import checkpoint_tokenizer_dir, record_of, save_tokenizer
from pretrain.utils.errors import UserError


def build_metadata(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    kind: str,
    tokenizer: TokenizerRecord | None = None,
    provenance: Provenance | None = None,
    add_binary_head: bool = False,
    fresh_heads: tuple[str, ...] = (),
    finetune: FinetuneRecord | None = None,
    module_names: str | None = None,
) -> CheckpointMetadata:
    """The record of a checkpoint we are about to write (fields as in :class:`CheckpointMetadata`);
    ``module_names`` defaults to megatron-core's names for GPT, legacy names for BERT."""
    provenance = provenance or Provenance()
    if provenance.toolkit_version is None:
        provenance = dataclasses.replace(provenance, toolkit_version=_toolkit_version())
    return CheckpointMetadata(
        kind=kind, model=model.without_memory_options(), parallel=parallel, tokenizer=tokenizer, provenance=provenance,
        add_binary_head=add_binary_head, fresh_heads=fresh_heads, finetune=finetune,
        module_names=module_names or kind_of(kind).default_module_names,
    )  # fmt: skip


def _toolkit_version() -> str | None:
    try:
        return _dist.version("mlm-toolkit")
    except _dist.PackageNotFoundError:
        return None


def checkpoint_args(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    model_type: str,
    extra: Mapping[str, object] | None = None,
) -> argparse.Namespace:
    """Megatron-named ``args`` (kept for callers of the earlier API); ``extra`` may hold ``argv``."""
    given = (extra or {}).get("argv")
    argv = tuple(str(a) for a in given) if isinstance(given, (list, tuple)) else ()
    return to_args(build_metadata(model, parallel, kind=model_type, provenance=Provenance(argv=argv)))


def model_config_from_args(args: object, *, source: str = "checkpoint") -> ModelConfig:
    """The ``ModelConfig`` of one of our checkpoints' ``args``."""
    return require_metadata(args, source=source).model


def parallel_config_from_args(args: object) -> ParallelConfig:
    """The layout a checkpoint was saved with."""
    return parallel_of(args)


def training_metadata(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    kind: str,
    tokenizer: Tokenizer,
    save: str | None,
    write_tokenizer: bool,
    argv: list[str] | tuple[str, ...] = (),
    global_batch_size: int | None = None,
    finetune: FinetuneRecord | None = None,
    module_names: str | None = None,
    data_hash: str | None = None,
) -> CheckpointMetadata:
    """The record of a training run's checkpoints; the writer rank (``write_tokenizer``) copies
    the tokenizer's files into ``SAVE/tokenizer/`` so the checkpoint carries them."""
    if tokenizer.vocab_size > model.vocab_size:
        raise UserError(
            f"the tokenizer ({tokenizer.tokenizer_type}) has {tokenizer.vocab_size} tokens but the model's "
            f"vocabulary is {model.vocab_size}"
        )
    record = record_of(tokenizer)
    if save is not None and write_tokenizer:
        save_tokenizer(tokenizer, checkpoint_tokenizer_dir(save))
    prov = Provenance(argv=tuple(argv), global_batch_size=global_batch_size, data_hash=data_hash)
    return build_metadata(model, parallel, kind=kind, tokenizer=record, provenance=prov,
                          add_binary_head=kind_of(kind).has_binary_head, finetune=finetune, module_names=module_names)  # fmt: skip
