"""The registry of model families: one :class:`Family` per Hugging Face ``model_type`` we convert.

A family names its Hugging Face ``model_type`` and architecture, the *converter* module that maps its
configs and tensors to ours (``pretrain.models.families.gpt2``, ``.llama``, ``.bert`` or any module
with the same functions, see ``docs/adding-a-family.md``), and what it switches on: the
:class:`~pretrain.config.ModelConfig` values that make a checkpoint this family rather than a sibling
with the same tensors (Qwen2 is Llama with ``add_qkv_bias``). Everything that depends on the
family asks the registry: the importer's dispatch, its refusal of an unknown ``model_type`` and
``mlm-convert --help`` (:func:`supported_model_types`), and which family an export goes to
(:func:`export_family`). A checkpoint imported from Hugging Face records its family's
``model_type`` (``provenance.source_model_type``) and is exported back to it when it still holds
the model.

Importable without torch or transformers (``mlm-convert --help`` uses it).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType

from pretrain.model_option_hf import family_switches


@dataclass(frozen=True, kw_only=True)
class Family:
    """One Hugging Face model family (see the module docstring).

    ``converter``: the converter module's name under ``pretrain.models.families`` (or a full
    module path); ``kind``: which of our models computes it (``gpt`` or ``bert``); ``moe``: its
    MLPs are mixtures of experts (it holds a config only when ``num_experts`` is set, a dense
    family only when it is not); ``switches``: the ``ModelConfig`` values the family fixes;
    ``hf_extra``: constant ``config.json`` keys it writes; ``export_default``: the family chosen
    for a matching config that records no family (Llama rather than Mistral, whose tensors are
    the same).
    """

    model_type: str
    architecture: str
    converter: str
    kind: str = "gpt"
    moe: bool = False
    switches: Mapping[str, object] = field(default_factory=dict)
    hf_extra: Mapping[str, object] = field(default_factory=dict)
    export_default: bool = True

    def holds(self, values: Mapping[str, object]) -> bool:
        """Whether a model with these ``ModelConfig`` values is this family (its MLP kind and its
        switches match)."""
        if (values.get("num_experts") is not None) != self.moe:
            return False
        return all(values.get(k) == v for k, v in self.switches.items())

    def module(self) -> ModuleType:
        """The converter module (imported on first use: it needs torch)."""
        name = self.converter if "." in self.converter else f"pretrain.models.families.{self.converter}"
        return importlib.import_module(name)


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` (a later registration of the same ``model_type`` replaces the earlier one)."""
    _REGISTRY[family.model_type] = family
    return family


def unregister(model_type: str) -> None:
    """Remove a family (for tests that register a temporary one)."""
    _REGISTRY.pop(model_type, None)


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(_REGISTRY.values())


def family_of_model_type(model_type: str | None) -> Family | None:
    """The family registered for a Hugging Face ``model_type`` (None when there is none)."""
    return _REGISTRY.get(model_type or "")


def export_family(values: Mapping[str, object], kind: str, *, recorded: str | None = None) -> Family:
    """The family an export of a ``kind`` model with ``ModelConfig`` ``values`` goes to.

    Among the families of that kind whose switches match: the one the checkpoint ``recorded`` when
    it is one of them, else the first marked ``export_default``, else the first. When none matches,
    the recorded family if it has the model's kind and MLP kind (dense or MoE), else the first of
    them whose first switch matches (or the first of that MLP kind, or the kind's first family): its converter then refuses the export,
    naming the options its architecture lacks.
    """
    same_kind = [f for f in families() if f.kind == kind]
    if not same_kind:
        raise LookupError(f"no model family of kind {kind!r} is registered")
    holding = [f for f in same_kind if f.holds(values)]
    for f in holding:
        if f.model_type == recorded:
            return f
    if holding:
        return next((f for f in holding if f.export_default), holding[0])
    moe = values.get("num_experts") is not None
    same_mlp = [f for f in same_kind if f.moe == moe] or same_kind
    for f in same_mlp:  # the recorded family refuses in its own words (what a Qwen2-MoE lacks)
        if f.model_type == recorded:
            return f
    for f in same_mlp:
        first = next(iter(f.switches.items()), None)
        if first is not None and values.get(first[0]) == first[1]:
            return f
    return same_mlp[0]


def supported_model_types() -> str:
    """``'gpt2', 'llama', ... or 'megatron-bert'``: the readable ``model_type`` values, for messages."""
    names = [repr(f.model_type) for f in families()]
    return ", ".join(names[:-1]) + " or " + names[-1]


def supported_architectures() -> str:
    """``GPT2LMHeadModel / LlamaForCausalLM / ...``: the families, for help texts."""
    return " / ".join(f.architecture for f in families())


def _builtin(model_type: str, **kw: object) -> Family:
    """A built-in family: its switches are the table's (``pretrain.model_options``, ``switches``)."""
    return Family(model_type=model_type, switches=family_switches(model_type), **kw)  # type: ignore[arg-type]


for _family in (
    _builtin("gpt2", architecture="GPT2LMHeadModel", converter="gpt2"),
    _builtin("llama", architecture="LlamaForCausalLM", converter="llama",
             hf_extra={"attention_bias": False, "mlp_bias": False}),
    _builtin("mistral", architecture="MistralForCausalLM", converter="llama", hf_extra={"sliding_window": None},
             export_default=False),
    _builtin("qwen2", architecture="Qwen2ForCausalLM", converter="llama", hf_extra={"sliding_window": None}),
    _builtin("qwen3", architecture="Qwen3ForCausalLM", converter="llama",
             hf_extra={"attention_bias": False, "sliding_window": None}),
    # mixtures of experts (converter pretrain.models.families.moe)
    _builtin("mixtral", architecture="MixtralForCausalLM", converter="moe", moe=True,
             hf_extra={"sliding_window": None}),
    _builtin("qwen2_moe", architecture="Qwen2MoeForCausalLM", converter="moe", moe=True),
    _builtin("qwen3_moe", architecture="Qwen3MoeForCausalLM", converter="moe", moe=True,
             hf_extra={"attention_bias": False}),
    _builtin("olmoe", architecture="OlmoeForCausalLM", converter="moe", moe=True,
             hf_extra={"attention_bias": False, "clip_qkv": None}),
    _builtin("bert", architecture="BertForPreTraining", converter="bert", kind="bert"),
    _builtin("megatron-bert", architecture="MegatronBertForPreTraining", converter="bert", kind="bert"),
):  # fmt: skip
    register(_family)
