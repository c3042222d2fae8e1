"""A Hugging Face ``config.json`` read as ``AutoConfig.from_pretrained`` reads it, without transformers.

Importing a family's config class costs seconds: ``configuration_llama`` pulls in transformers'
model-loading machinery and ``torch.distributed.tensor`` (sympy included), 2-2.6 s on a 2-core
host against 2-4 s for the whole conversion of a 1B model. ``mlm-convert from-hf`` and every
``--hf-model`` reader only need the values, so they read the file here:

* the class defaults of every field the file leaves out come from :data:`DEFAULTS_FILE`, a table
  generated from transformers' config dataclasses (``python -m tools.hf_config_json`` rewrites it
  from the installed version). It is used only while the installed transformers is the version it
  was made from (read from the package metadata, without importing it); any other version is
  read by ``AutoConfig`` as before (slower, never different);
* the class's ``attribute_map`` aliases (GPT-2's ``n_embd`` read as ``hidden_size``) resolve on
  attribute access, as on a ``PretrainedConfig``;
* what the config classes' ``__post_init__`` derive (``head_dim``, the key/value heads, a sliding
  window switched off by ``use_sliding_window``, ``mlp_only_layers``) and transformers 5's RoPE
  standardisation (``rope_theta`` / ``rope_scaling`` folded into ``rope_parameters``) are
  reproduced for the registered families.

The same test loads a corpus of configs (saved ones, minimal hand-written ones, older RoPE
spellings) through ``AutoConfig`` and through :func:`read_config_json` and requires the same
values and the same ``ModelConfig`` from each family's converter.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pretrain.utils.errors import UserError

DEFAULTS_FILE = Path(__file__).with_name("hf_config_defaults.json")
# RoPE types whose pretraining length transformers moves into rope_parameters (standardize_rope_params)
_SCALED_ROPE_TYPES = ("llama3", "yarn", "longrope")
_SWITCHED_WINDOW_OFF = {"qwen2_moe": 0}  # the value a switched-off window takes (else None)


class HFConfigJson:
    """The values of one ``config.json`` over its class defaults, read by attribute like a
    ``PretrainedConfig`` (``attribute_map`` aliases included); ``AttributeError`` for a key the
    file and the class both lack (so ``getattr(config, key, default)`` works as on theirs)."""

    def __init__(self, values: Mapping[str, object], attribute_map: Mapping[str, str]) -> None:
        self._values = dict(values)
        self._aliases = dict(attribute_map)

    def __getattr__(self, name: str) -> object:
        if name.startswith("_"):
            raise AttributeError(name)
        key = self._aliases.get(name, name)
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(f"config.json has no {name!r}") from None


@functools.cache
def _whole_table() -> dict[str, object]:
    with open(DEFAULTS_FILE, encoding="utf-8") as f:
        whole: dict[str, object] = json.load(f)
    return whole


def _table() -> dict[str, dict[str, object]]:
    table = _whole_table()["model_types"]
    assert isinstance(table, dict)
    return table


def table_facts(model_type: str) -> dict[str, object] | None:
    """What the table records of ``model_type``'s config class, with the base ``PretrainedConfig``
    defaults (``base_defaults``) and the ``transformers_version`` it was made from; None outside it."""
    facts = _table().get(model_type)
    if facts is None:
        return None
    whole = _whole_table()
    return {
        **facts,
        "base_defaults": whole["base_defaults"],
        "transformers_version": whole["transformers_version"],
    }


def generation_facts() -> tuple[tuple[str, ...], dict[str, object]]:
    """``GenerationConfig``'s parameters and their defaults, from the table."""
    gen = _whole_table()["generation_defaults"]
    assert isinstance(gen, dict)
    return tuple(gen), gen


def table_version() -> str:
    """The transformers version :data:`DEFAULTS_FILE` was generated from (and proved against)."""
    version = _whole_table()["transformers_version"]
    assert isinstance(version, str)
    return version


@functools.cache
def installed_version() -> str | None:
    """The installed transformers' version, from its package metadata (no import of it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def table_matches_installed() -> bool:
    """Whether the table speaks for the installed transformers: another version may change a
    default or the RoPE rules, so :func:`load_hf_config` then asks ``AutoConfig`` itself."""
    return installed_version() == table_version()


def read_config_json(model_dir: Path, *, flag: str = "--load") -> HFConfigJson:
    """``model_dir/config.json`` with its class's defaults filled in (see the module docstring).

    One :class:`UserError` line naming the file for what is not a JSON object with a
    ``model_type`` of the table; a ``model_type`` outside it is left to the caller's refusal
    (the returned config then holds the file's values alone)."""
    path = model_dir / "config.json"
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(
            f"{flag} {model_dir}: cannot read config.json ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(raw, dict):
        raise UserError(f"{flag} {model_dir}: config.json holds a {type(raw).__name__}, not a JSON object")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise UserError(f"{flag} {model_dir}: config.json has no model_type")
    try:
        return config_from_dict(raw)
    except ValueError as exc:
        raise UserError(f"{flag} {model_dir}: config.json: {exc}") from None


def load_hf_config(model_dir: Path, *, flag: str = "--load") -> object:
    """``model_dir``'s config: read here when its ``model_type`` is in the table (the built-in
    families) and the table was made from the installed transformers version, else by
    ``AutoConfig.from_pretrained`` (a family registered at run time, a ``model_type`` the caller
    refuses, another transformers); one :class:`UserError` line for an unreadable file."""
    config = read_config_json(model_dir, flag=flag)
    if config.model_type in _table() and table_matches_installed():
        return config
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many kinds
        raise UserError(
            f"{flag} {model_dir}: cannot read config.json ({type(exc).__name__}: {exc})"
        ) from None


def config_from_dict(raw: Mapping[str, object]) -> HFConfigJson:
    """The config of a parsed ``config.json`` (``model_type`` included) over its class defaults."""
    model_type = str(raw.get("model_type"))
    facts = _table().get(model_type)
    if facts is None:
        return HFConfigJson(raw, {})
    given = copy.deepcopy(dict(raw))
    if "torch_dtype" in given:  # transformers' older spelling; ``dtype`` wins when both are there
        dtype = given.pop("torch_dtype")
        given.setdefault("dtype", dtype)
    aliases = facts["attribute_map"]
    assert isinstance(aliases, dict)
    return HFConfigJson(derived_values(model_type, given), aliases)


def derived_values(model_type: str, given: dict[str, object]) -> dict[str, object]:
    """``model_type``'s class defaults overlaid with ``given`` (a file's values or an export's
    keyword arguments; type-checked), then what the class's ``__post_init__`` derives and the
    RoPE standardisation: the values a ``PretrainedConfig`` of them holds."""
    facts = _table()[model_type]
    defaults, aliases = copy.deepcopy(facts["defaults"]), facts["attribute_map"]
    assert isinstance(defaults, dict) and isinstance(aliases, dict)
    # an alias names its field (Qwen3-MoE's num_experts is num_local_experts), set after the field
    given = {k: given[k] for k in sorted(given, key=lambda k: k in aliases)}
    given = {aliases.get(k, k): v for k, v in given.items()}
    # a field named as an alias is only ever stored under its target (``__setattr__`` redirects it)
    defaults = {k: v for k, v in defaults.items() if k not in aliases}
    _check_types(given, defaults)
    values = {**defaults, **copy.deepcopy(given)}
    _derive(values, model_type)
    if "rope_parameters" in defaults:
        _standardise_rope(values, defaults, facts)
    return values


def _check_types(given: Mapping[str, object], defaults: Mapping[str, object]) -> None:
    """``ValueError`` for a value of another JSON type than its field's default (an integer field
    given ``"64"``): transformers' strict dataclasses refuse these at load, before any converter."""
    for key, value in given.items():
        default = defaults.get(key)
        if default is None or value is None or not isinstance(value, str | int | float):
            continue  # (a list where the default is one id: Llama 3's eos_token_id is legal)
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        else:
            continue
        if not ok:
            raise ValueError(f"{key} must be {type(default).__name__}, got {value!r}")


def _derive(values: dict[str, object], model_type: str) -> None:
    """What the registered families' config ``__post_init__`` derive from the other values."""
    if values.get("num_key_value_heads", 0) is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values.get("head_dim", 0) is None and model_type in ("llama", "mistral"):
        hidden, heads = values["hidden_size"], values["num_attention_heads"]
        values["head_dim"] = (
            hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
        )
    if "use_sliding_window" in values and not values["use_sliding_window"]:
        values["sliding_window"] = _SWITCHED_WINDOW_OFF.get(model_type)
    if values.get("mlp_only_layers", 0) is None:
        values["mlp_only_layers"] = []
    if values.get("layer_types", 0) is None and model_type in _LAYER_TYPES:
        layers = values["num_hidden_layers"]
        values["layer_types"] = [
            _LAYER_TYPES[model_type](values, i) for i in range(layers if isinstance(layers, int) else 0)
        ]


def _qwen2_layer(values: Mapping[str, Any], i: int) -> str:
    window = values["sliding_window"] is not None and i >= values["max_window_layers"]
    return "sliding_attention" if window else "full_attention"


def _qwen2_moe_layer(values: Mapping[str, Any], i: int) -> str:
    window = bool((i + 1) % 2) and i < values["max_window_layers"] and values["use_sliding_window"]
    return "sliding_attention" if window else "full_attention"


# the attention kind per layer the Qwen configs derive when the file gives none (``__post_init__``)
_LAYER_TYPES = {"qwen2": _qwen2_layer, "qwen3": _qwen2_layer, "qwen2_moe": _qwen2_moe_layer}


def _standardise_rope(
    values: dict[str, object], fields: Mapping[str, object], facts: Mapping[str, object]
) -> None:
    """transformers 5's ``convert_rope_params_to_dict`` + ``standardize_rope_params`` for one
    global (not per-layer-type) RoPE: ``rope_scaling`` replaces ``rope_parameters``, then
    ``rope_theta`` / ``partial_rotary_factor`` (the file's, else the class default) and the
    ``rope_type`` (``type``'s older spelling) are filled in; the legacy keys leave the config."""
    scaling = values.pop("rope_scaling", None)
    params = scaling or values.get("rope_parameters")
    params = dict(params) if isinstance(params, dict) else {}
    # a key that is no field of the class is consumed here; a field stays an attribute
    theta = (values.get if "rope_theta" in fields else values.pop)("rope_theta", facts["default_theta"])
    partial = (values.get if "partial_rotary_factor" in fields else values.pop)("partial_rotary_factor", None)
    if params or theta:
        params.setdefault("rope_theta", theta)
        if partial is not None:
            params.setdefault("partial_rotary_factor", partial)
        params.setdefault("rope_type", params.get("type", "default"))
        if facts["default_rope_type"] != "default" and params["rope_type"] == "default":
            params["rope_type"] = facts["default_rope_type"]
        if params["rope_type"] in _SCALED_ROPE_TYPES:
            if "original_max_position_embeddings" in values:
                params["original_max_position_embeddings"] = values["original_max_position_embeddings"]
            else:
                params.setdefault("original_max_position_embeddings", values.get("max_position_embeddings"))
    values["rope_parameters"] = params


def class_facts(model_type: str) -> dict[str, object]:
    """What :data:`DEFAULTS_FILE` records of ``model_type``'s config class, read from the installed
    transformers (imports it): each dataclass field's default, ``attribute_map``, the RoPE defaults."""
    import dataclasses

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return {
        "class": cls.__name__,
        "defaults": defaults,
        "attribute_map": dict(cls.attribute_map),
        "default_theta": getattr(cls, "default_theta", None),
        "default_rope_type": getattr(cls, "default_rope_type", "default"),
    }


def generated_table() -> dict[str, object]:
    """The whole table for the registered families, from the installed transformers."""
    import transformers
    from transformers import GenerationConfig, PretrainedConfig

    from pretrain.models.families import families

    base = PretrainedConfig().to_dict()
    base.pop("transformers_version")
    generation = GenerationConfig().to_dict()
    for metadata in ("_from_model_config", "_commit_hash", "_original_object_hash", "transformers_version"):
        generation.pop(metadata, None)
    return {
        "transformers_version": transformers.__version__,
        "base_defaults": base,
        "generation_defaults": generation,
        "model_types": {f.model_type: class_facts(f.model_type) for f in families()},
    }


def main() -> None:
    """``python -m tools.hf_config_json``: rewrite :data:`DEFAULTS_FILE` from the installed transformers."""
    text = json.dumps(generated_table(), indent=1, sort_keys=True) + "\n"
    DEFAULTS_FILE.write_text(text, encoding="utf-8")
    print(f"wrote {DEFAULTS_FILE}")


if __name__ == "__main__":
    main()
