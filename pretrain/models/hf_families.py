"""The Hugging Face model types ``mlm-convert from-hf`` reads: one table, importable without torch.

:data:`LLAMA_FAMILIES` says what each Llama-family config switches on (used by
:mod:`pretrain.models.hf_llama`); :data:`HF_MODEL_TYPES` maps every readable ``model_type`` to the
architecture it names, so that the importer's dispatch, its refusal of an unknown type and
``mlm-convert --help`` list the same families.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One Hugging Face Llama-style family: its architecture and what its config turns on."""

    model_type: str
    architecture: str
    qkv_bias: bool  # q/k/v projections always carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm of queries and keys (Qwen3)


LLAMA_FAMILIES = {
    f.model_type: f
    for f in (
        Family("llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False),
        Family("mistral", "MistralForCausalLM", qkv_bias=False, qk_norm=False),
        Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False),
        Family("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True),
    )
}
BERT_MODEL_TYPES = {"bert": "BertForPreTraining", "megatron-bert": "MegatronBertForPreTraining"}
# model_type -> architecture, for every Hugging Face family from-hf imports.
HF_MODEL_TYPES: dict[str, str] = {
    "gpt2": "GPT2LMHeadModel",
    **{t: f.architecture for t, f in LLAMA_FAMILIES.items()},
    **BERT_MODEL_TYPES,
}


def supported_model_types() -> str:
    """``'gpt2', 'llama', ... or 'megatron-bert'``: the readable ``model_type`` values, for messages."""
    names = [repr(t) for t in HF_MODEL_TYPES]
    return ", ".join(names[:-1]) + " or " + names[-1]


def supported_architectures() -> str:
    """``GPT2LMHeadModel / LlamaForCausalLM / ...``: the families, for help texts."""
    return " / ".join(HF_MODEL_TYPES.values())
