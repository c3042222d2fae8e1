"""Which module names a model chunk is written under in the legacy ``torch`` format.

* ``"mcore"`` (default for GPT models): megatron-core's flat ``state_dict`` names of its local
  spec, what current Megatron-LM's ``load_checkpoint`` loads into its ``GPTModel``
  (``embedding.word_embeddings.weight``, ``decoder.layers.N.self_attention.linear_qkv.weight``,
  ``decoder.layers.N.pre_mlp_layernorm.weight``, ``decoder.final_layernorm.weight``,
  ``output_layer.weight`` on the last of several stages), with the ``_extra_state`` entries
  (``None``) its linear layers keep, so a strict ``load_state_dict`` matches every key.
* ``"legacy"``: Megatron's nested legacy names (``model["language_model"]["encoder"]["layers.N..."]``),
  read by older Megatron-LM and Hugging Face's ``convert_megatron_gpt2_checkpoint.py``.

Layer indices stay local to the chunk in both (as each writes them). Both are read back by
:func:`chunk_from_file` (and by the upstream readers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from pretrain.checkpoint.legacy.layout import flatten, nest_megatron
from pretrain.checkpoint.upstream.names import to_mcore_state_name
from pretrain.models.kinds import kind_of
from pretrain.utils.errors import UserError

MODULE_NAMES = ("mcore", "legacy")
_LAYER = re.compile(r"^language_model\.encoder\.layers\.(\d+)\.(.*)$")
_LINEAR_WEIGHT = re.compile(
    r"^decoder\.layers\.\d+\..*\b(linear_qkv|linear_proj|linear_fc1|linear_fc2)\.weight$"
)


def mcore_name(local: str) -> str:
    """megatron-core's flat name of one of our GPT chunk's local parameter names (the one name
    table, :func:`pretrain.checkpoint.upstream.names.to_mcore_state_name`)."""
    try:
        return to_mcore_state_name(local, "gpt")
    except ValueError:
        raise UserError(
            f"tensor {local}: no megatron-core name (write it with --module-names legacy)"
        ) from None


def _mcore_state(flat: Mapping[str, object]) -> dict[str, Any]:
    out: dict[str, Any] = {mcore_name(k): v for k, v in flat.items()}
    # every linear layer keeps an _extra_state entry: the dense ones, each expert's, the shared expert's
    for key in list(out):
        if _LINEAR_WEIGHT.match(key):
            out[key.removesuffix("weight") + "_extra_state"] = None
    if any(k.startswith("language_model.encoder.final_layernorm.") for k in flat):  # the last stage
        out["output_layer._extra_state"] = None
    return out


def chunk_to_file(flat: Mapping[str, object], *, names: str, kind: str) -> dict[str, Any]:
    """A chunk's local tensors (or placeholders of them) as its ``model``/``model{i}`` entry under ``names``."""
    if names not in MODULE_NAMES:
        raise UserError(f"--module-names {names!r}: expected one of {', '.join(MODULE_NAMES)}")
    if names == "legacy" or not kind_of(kind).mcore_names:  # e.g. megatron-core BERT: none for our heads
        return nest_megatron(flat)
    return _mcore_state(flat)


def chunk_from_file(entry: dict[str, Any], expected: list[str]) -> dict[str, torch.Tensor]:
    """Our local tensors of a ``model``/``model{i}`` entry written under either names.

    ``expected`` are the chunk's local names; a name absent under both spellings is left out
    (the caller reports missing tensors)."""
    flat = flatten(entry)
    out: dict[str, torch.Tensor] = {}
    for local in expected:
        if local in flat:
            out[local] = flat[local]
            continue
        try:
            theirs = mcore_name(local)
        except UserError:
            continue
        if theirs in flat:
            out[local] = flat[theirs]
    return out


def file_keys(expected: list[str]) -> set[str]:
    """Every key a chunk with local names ``expected`` may hold in a file (either spelling)."""
    out = set(expected)
    for local in expected:
        try:
            out.add(mcore_name(local))
        except UserError:
            continue
    return out
