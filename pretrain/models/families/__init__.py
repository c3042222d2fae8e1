"""Model families: one converter module per architecture and one registry of Hugging Face families.

* :mod:`~pretrain.models.families.registry` -- :class:`Family` (a ``model_type``, its architecture,
  its converter, what it switches on) and the registry every family-dependent choice asks;
* :mod:`~pretrain.models.families.gpt2`, :mod:`~pretrain.models.families.llama` (Llama, Mistral,
  Qwen2, Qwen3), :mod:`~pretrain.models.families.bert` (BERT, Megatron-BERT) -- the converters:
  config and tensor mappings between our canonical checkpoints and Hugging Face, exact or refused.

``docs/adding-a-family.md`` lists the steps to add one. Importing this package imports neither
torch nor transformers.
"""

from pretrain.models.families.registry import (
    Family,
    export_family,
    families,
    family_of_model_type,
    register,
    supported_architectures,
    supported_model_types,
    unregister,
)

__all__ = [
    "Family", "export_family", "families", "family_of_model_type", "register", "supported_architectures",
    "supported_model_types", "unregister",
]  # fmt: skip
