"""The model kinds: which of our model classes computes a checkpoint, and what that implies.

A checkpoint records its kind as a string (``"gpt"`` or ``"bert"``, the ``kind`` field of its
metadata and Megatron's ``args.model_type``). Code outside the model asks the :class:`ModelKind`
of that string (:func:`kind_of`) for the fact it needs -- whether the model is a causal LM with
logits, has BERT's heads, which megatron-core block holds its layers -- rather than comparing the
string. A family is a *kind* plus a converter (:mod:`pretrain.models.families.registry`): a
decoder with another MLP (Mixture-of-Experts) is still the ``gpt`` kind.

Importable without torch (the model classes are imported when :meth:`ModelKind.build` runs).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pretrain.utils.errors import UserError

if TYPE_CHECKING:
    from pretrain.config import ModelConfig
    from pretrain.models.base import ShardedModule
    from pretrain.parallel.state import ParallelState


@dataclass(frozen=True, kw_only=True)
class ModelKind:
    """One model kind (see the module docstring).

    ``name``: the recorded string; ``model_class``: ``module:Class`` of our model;
    ``causal_lm``: a decoder whose output is next-token logits ``[b, s, V]`` (else an encoder whose
    probe output is the final hidden states ``[b, s, h]``); ``bidirectional``: its attention sees
    the whole sequence; ``has_mlm_head`` / ``has_binary_head``: BERT's masked-LM head (dense,
    norm, GeLU) and sentence-order head; ``tokentypes``: token-type embeddings a fresh model of
    the kind is trained with; ``mcore_block``: the megatron-core module holding the layers
    (``decoder`` / ``encoder``); ``mcore_names``: megatron-core has names for all its tensors
    (else files keep Megatron's legacy names); ``hf_auto_class``: the ``transformers`` auto class
    that loads its Hugging Face export; ``name_markers``: local tensor-name prefixes that only
    this kind holds (tells an upstream checkpoint's kind when its args do not).
    """

    name: str
    model_class: str
    causal_lm: bool
    bidirectional: bool
    has_mlm_head: bool
    has_binary_head: bool
    tokentypes: int
    mcore_block: str
    mcore_names: bool
    hf_auto_class: str
    name_markers: tuple[str, ...] = ()
    help: str = ""

    @property
    def probe_output(self) -> str:
        """What a verification probe compares: ``logit`` or ``hidden-state``."""
        return "logit" if self.causal_lm else "hidden-state"

    @property
    def default_module_names(self) -> str:
        """The tensor names a checkpoint of this kind is written under by default."""
        return "mcore" if self.mcore_names else "legacy"

    def build(
        self, cfg: ModelConfig, ps: ParallelState, *, add_binary_head: bool = False,
        pre_process: bool = True, post_process: bool = True, layer_numbers: Sequence[int] | None = None,
    ) -> ShardedModule:  # fmt: skip
        """Our model of this kind (``add_binary_head`` is ignored by kinds without that head)."""
        module, cls = self.model_class.split(":")
        model_type = getattr(importlib.import_module(module), cls)
        kw: dict[str, object] = dict(
            pre_process=pre_process, post_process=post_process, layer_numbers=layer_numbers
        )
        if self.has_binary_head:
            kw["add_binary_head"] = add_binary_head
        model: ShardedModule = model_type(cfg, ps, **kw)
        return model


GPT = ModelKind(
    name="gpt", model_class="pretrain.models.gpt:GPTModel", causal_lm=True, bidirectional=False,
    has_mlm_head=False, has_binary_head=False, tokentypes=0, mcore_block="decoder", mcore_names=True,
    hf_auto_class="AutoModelForCausalLM", help="GPT-2 style decoder (next-token prediction)",
)  # fmt: skip
BERT = ModelKind(
    name="bert", model_class="pretrain.models.bert:BertModel", causal_lm=False, bidirectional=True,
    has_mlm_head=True, has_binary_head=True, tokentypes=2, mcore_block="encoder", mcore_names=False,
    hf_auto_class="AutoModel", help="BERT encoder (masked LM + sentence order)",
    name_markers=("lm_head.", "binary_head.", "language_model.embedding.tokentype_embeddings."),
)  # fmt: skip
KINDS: dict[str, ModelKind] = {k.name: k for k in (GPT, BERT)}


def is_kind(name: object) -> bool:
    """Whether ``name`` is a recorded kind we know."""
    return isinstance(name, str) and name in KINDS


def kind_of(name: str, *, where: str = "checkpoint") -> ModelKind:
    """The kind recorded as ``name``; :class:`UserError` (one line, naming ``where``) when unknown."""
    if not is_kind(name):
        raise UserError(f"{where}: unknown model kind {name!r} (expected one of {', '.join(KINDS)})")
    return KINDS[name]


def kind_of_names(local_names: Iterable[str]) -> ModelKind:
    """The kind whose :attr:`ModelKind.name_markers` some of ``local_names`` start with (else GPT)."""
    names = list(local_names)
    for kind in KINDS.values():
        if kind.name_markers and any(n.startswith(kind.name_markers) for n in names):
            return kind
    return GPT


def kind_of_config(cfg: ModelConfig) -> ModelKind:
    """The kind computing ``cfg`` when nothing records it (a bidirectional config is BERT)."""
    return next(k for k in KINDS.values() if k.bidirectional == cfg.bidirectional)
