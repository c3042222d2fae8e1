"""A LoRA checkpoint opened as the model it stands for: its base with the adapter merged.

:func:`~pretrain.checkpoint.opener.open_checkpoint` hands a LoRA checkpoint (one holding
``lora_adapter.pt``, see :mod:`pretrain.checkpoint.lora_adapter`) to :func:`open_lora`: the base
checkpoint the adapter names is opened, its weights fingerprint checked against the recorded one
(one line on a mismatch), and every command that reads checkpoints (``mlm-eval --ckpt``,
``mlm-generate --ckpt``, the harness backend, ``reshard``, ``inspect``) sees the merged weights
(``W + (alpha/r) B A`` in fp32, cast to the base dtype), one tensor at a time. The base's
``info``, ``metadata`` and ``args`` (and its ``tokenizer/``) stand for the merged model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.checkpoint.fingerprint import scheme_of, weights_fingerprint
from pretrain.checkpoint.lora_adapter import LoraAdapter, check_base, read_adapter
from pretrain.checkpoint.plan import ModelSpec
from pretrain.checkpoint.types import CheckpointInfo, CheckpointMetadata, CheckpointReader
from pretrain.models.lora import merged_tensor
from pretrain.utils.errors import UserError


@dataclass
class MergedLoraReader:
    """A :class:`CheckpointReader` of ``base`` with ``adapter`` merged into its tensors."""

    base: CheckpointReader
    adapter: LoraAdapter

    @property
    def spec(self) -> ModelSpec:
        return self.base.spec

    @property
    def info(self) -> CheckpointInfo:
        return self.base.info

    @property
    def metadata(self) -> CheckpointMetadata | None:
        return self.base.metadata

    @property
    def args(self) -> Mapping[str, object]:
        return self.base.args

    def names(self) -> list[str]:
        return self.base.names()

    def _merged(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        return merged_tensor(
            name, weight, self.adapter.tensors, self.spec.cfg, scaling=self.adapter.lora.scaling
        )

    def tensor(self, name: str) -> torch.Tensor:
        return self._merged(name, self.base.tensor(name))

    def stored_rows(self, name: str) -> torch.Tensor:
        return self._merged(name, self.base.stored_rows(name))

    def with_vocab(self, vocab_size: int, *, source: str = "") -> MergedLoraReader:
        return MergedLoraReader(self.base.with_vocab(vocab_size, source=source), self.adapter)


def open_lora(
    path: Path, iteration: int | str | None, *, open_base: Callable[..., CheckpointReader],
    vocab_size: int | None, tokenizer_size: int | None, tokenizer_source: str,
) -> CheckpointReader:  # fmt: skip
    """Open the LoRA checkpoint at ``path`` (root or iteration directory) as its merged model;
    ``open_base`` (``open_checkpoint``, passed in: the opener imports this module) opens the base."""
    adapter = read_adapter(path, iteration)
    base = Path(adapter.base.path)
    if (base / "config.json").is_file():
        raise UserError(
            f"{path}: the LoRA adapter's base {base} is a Hugging Face directory; import it with "
            "mlm-convert from-hf, or export the merged model with mlm-convert to-hf"
        )
    if not base.exists():
        raise UserError(f"{path}: the LoRA adapter's base {base} does not exist")
    reader = open_base(base, vocab_size=vocab_size, tokenizer_size=tokenizer_size,
                             tokenizer_source=tokenizer_source)  # fmt: skip
    # hashed under the scheme the adapter recorded its base with (w1 adapters stay loadable)
    check_base(
        adapter, weights_fingerprint(reader, scheme=scheme_of(adapter.base.fingerprint)), where=str(path)
    )
    return MergedLoraReader(reader, adapter)
