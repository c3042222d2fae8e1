"""What every family converter module provides (``docs/adding-a-family.md``).

A converter maps one architecture's Hugging Face configs and tensors to our canonical ones, for
every :class:`~pretrain.models.families.registry.Family` that names it. It is a module with the
functions of :class:`Converter`; tools at the edge (``tools/hf_io.py``) call only these.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from pretrain.config import ModelConfig
from pretrain.utils.buffer_pool import pooled_cat, pooled_copy

if TYPE_CHECKING:
    from pretrain.models.families.registry import Family

TensorMaker = Callable[[], torch.Tensor]
# a canonical tensor as row blocks of the HF tensors (views where they lie), joined along dim 0
RowPartsMaker = Callable[[], tuple[torch.Tensor, ...]]


def joined_rows(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The tensor whose row blocks are ``parts``, in memory of its own (a pooled buffer during a
    conversion; one contiguous part itself within ``read_only_views``)."""
    return pooled_copy(parts[0]) if len(parts) == 1 else pooled_cat(list(parts))


def makers_from_row_parts(row_parts: Mapping[str, RowPartsMaker]) -> dict[str, TensorMaker]:
    """Each canonical tensor's maker as the join of its row blocks: the one definition of how a
    family arranges its HF tensors serves the joined path and the writers' pieces alike."""
    return {name: functools.partial(_join, make) for name, make in row_parts.items()}


def _join(make: RowPartsMaker) -> torch.Tensor:
    return joined_rows(make())


@dataclass(frozen=True, kw_only=True)
class HFImport:
    """A Hugging Face model read as ours: its config, a maker per canonical tensor (each builds one
    full tensor from the memory-mapped HF weights when called), and the BERT heads the HF model
    lacked (``fresh_heads``, initialised here; ``add_binary_head``: a next-sentence head exists).

    ``row_parts`` (optional, per canonical name): the HF tensors' row blocks whose join along dim 0
    is that maker's tensor, as views of the mapped weights (a fused QKV: each group's q, k and v
    rows; SwiGLU's fc1: gate, up; a plain tensor: itself). A writer cuts its shards from them and
    the fingerprint hashes them where they lie, with no copy of the tensor."""

    cfg: ModelConfig
    makers: dict[str, TensorMaker]
    row_parts: dict[str, RowPartsMaker] = field(default_factory=dict)
    add_binary_head: bool = False
    fresh_heads: tuple[str, ...] = ()


class HFConfig(Protocol):
    """What a converter reads of a Hugging Face config by name: a ``transformers``
    ``PretrainedConfig`` (GPT-2's ``n_head``/``n_embd``/``n_positions`` included, through its
    ``attribute_map``) or any object with these attributes. Keys only some families have, or
    that may be absent, are read with ``getattr(config, key, default)``."""

    model_type: str
    hidden_size: int
    num_attention_heads: int
    max_position_embeddings: int


class Converter(Protocol):
    """The functions of a converter module."""

    def import_hf(
        self, state: Mapping[str, torch.Tensor], hf_config: HFConfig, family: Family, **overrides: object
    ) -> HFImport:
        """The HF model (``state``: its tensors, memory-mapped) as ours; refuses (one line) what
        our model cannot compute exactly."""
        ...

    def check_exportable(self, cfg: ModelConfig, *, family: Family | None = None) -> None:
        """Raise ``UserError`` naming every option of ``cfg`` the architecture cannot express
        (``family``: the one the export goes to, for a converter whose families differ in more
        than their switches; None: the config's)."""
        ...

    def export_config(
        self,
        cfg: ModelConfig,
        family: Family,
        *,
        special_ids: Mapping[str, int | None],
        fresh_heads: tuple[str, ...],
    ) -> dict[str, object]:
        """``config.json`` keyword arguments (``architectures`` included, ``model_type`` not)."""
        ...

    def export_tensors(
        self,
        full: Mapping[str, torch.Tensor],
        cfg: ModelConfig,
        *,
        fresh_heads: tuple[str, ...],
        family: Family | None = None,
        copy: bool = True,
    ) -> dict[str, torch.Tensor]:
        """The HF state dict of canonical ``full`` tensors (tied copies omitted; ``family``: as
        for :meth:`check_exportable`, the names of the MoE families differ). ``copy=False``: an
        output may share memory with ``full`` (the streamed writer, which only writes it out,
        saves a copy of every tensor)."""
        ...
