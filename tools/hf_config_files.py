"""``config.json`` and ``generation_config.json`` of an export, written as transformers writes them,
without importing it.

``AutoConfig.for_model(model_type, **kwargs)`` followed by ``save_pretrained`` (and
``GenerationConfig.from_model_config(config).save_pretrained``) costs seconds of imports
(``configuration_llama`` pulls in ``torch.distributed.tensor``); a ``--weights-only`` export
needs nothing else from transformers. Here the same text is made from the table of
:mod:`tools.hf_config_json` (class defaults, the base ``PretrainedConfig`` defaults, the
generation parameters):

* the config is the class defaults overlaid with the export's keyword arguments, with what the
  class's ``__post_init__`` derives (:func:`tools.hf_config_json.derived_values`) and RoPE
  standardised;
* ``config.json`` is ``to_diff_dict``: every key of the class's own, and a base key only where it
  differs from the base default (or the class overrides that default), ``model_type`` and
  ``transformers_version`` always; sorted, indented by 2, as ``to_json_string``;
* ``generation_config.json`` is ``from_model_config``: each generation parameter the model config
  holds (not None), ``_from_model_config``, and ``return_dict_in_generate`` once an output flag
  is set.

:func:`config_files` returns ``None`` where the table cannot speak (another transformers version, a
family outside it): the caller then asks transformers. ``tests/test_hf_config_files.py`` compares
the bytes with transformers' own for every family.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from tools.hf_config_json import derived_values, generation_facts, table_facts, table_matches_installed

_OUTPUT_FLAGS = ("output_attentions", "output_hidden_states", "output_scores", "output_logits")


def config_files(
    model_type: str, kwargs: Mapping[str, object], *, dtype: torch.dtype | None, causal_lm: bool
) -> dict[str, str] | None:
    """``{"config.json": text, "generation_config.json": text}`` (the latter for a causal LM) of
    ``AutoConfig.for_model(model_type, **kwargs)`` with ``config.dtype = dtype``; ``None`` where
    only transformers can say."""
    facts = table_facts(model_type)
    if facts is None or not table_matches_installed():
        return None
    full = _full_dict(model_type, kwargs, dtype, facts)
    files = {"config.json": _dumps(_diff(full, facts))}
    if causal_lm:
        files["generation_config.json"] = _dumps(_generation(full, facts))
    return files


def _full_dict(
    model_type: str, kwargs: Mapping[str, object], dtype: torch.dtype | None, facts: Mapping[str, object]
) -> dict[str, object]:
    """``config.to_dict()``: the values after ``__post_init__``, with the serialised extras."""
    base = facts["base_defaults"]
    assert isinstance(base, dict)
    full = derived_values(model_type, dict(kwargs))
    full.update(
        dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        model_type=model_type,
        transformers_version=facts["transformers_version"],
        output_attentions=base["output_attentions"],
        id2label=base["id2label"],
        label2id=base["label2id"],
    )
    return {k: _lists(v) for k, v in full.items()}


def _lists(value: object) -> object:
    """Tuples as lists (``to_dict``), recursively."""
    if isinstance(value, tuple | list):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return value


def _diff(full: Mapping[str, object], facts: Mapping[str, object]) -> dict[str, object]:
    """``PreTrainedConfig.to_diff_dict``."""
    base, defaults = facts["base_defaults"], facts["defaults"]
    assert isinstance(base, dict) and isinstance(defaults, dict)
    class_defaults = {k: v for k, v in defaults.items() if v is not None}
    out = {}
    for key, value in full.items():
        if (
            key not in base
            or key == "transformers_version"
            or value != base[key]
            or value != class_defaults.get(key, value)
        ):
            out[key] = value
    out.pop("_name_or_path", None)
    return out


def _generation(full: Mapping[str, object], facts: Mapping[str, object]) -> dict[str, object]:
    """``GenerationConfig.from_model_config(config).to_diff_dict()``."""
    params, defaults = generation_facts()
    gen: dict[str, object] = {k: full[k] for k in params if full.get(k) is not None}
    if not gen.get("return_dict_in_generate") and any(gen.get(flag) for flag in _OUTPUT_FLAGS):
        gen["return_dict_in_generate"] = True
    out = {k: v for k, v in gen.items() if v != defaults.get(k)}
    out["_from_model_config"] = True
    out["transformers_version"] = facts["transformers_version"]
    return out


def _dumps(values: Mapping[str, object]) -> str:
    return json.dumps(values, indent=2, sort_keys=True) + "\n"
