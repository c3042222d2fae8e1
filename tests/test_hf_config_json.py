"""``config.json`` read without transformers (tools.hf_config_json) equals ``AutoConfig.from_pretrained``.

Each family's configs -- as ``save_pretrained`` writes them, minimal hand-written ones that lean on
the class defaults, older RoPE spellings, sliding windows, ``torch_dtype`` -- are read both ways:
every value transformers holds is the same on ours, and each family's converter gives the same
``ModelConfig`` (or the same refusal) from either.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.models.families import families, family_of_model_type
from pretrain.utils.errors import UserError
from tools import hf_config_json
from tools.hf_config_json import (
    DEFAULTS_FILE,
    HFConfigJson,
    generated_table,
    load_hf_config,
    read_config_json,
    table_matches_installed,
    table_version,
)

transformers = pytest.importorskip("transformers")

# the table speaks for one transformers version: with another installed, from-hf asks AutoConfig
# (test_another_transformers_version_is_read_by_autoconfig), and the parity tests below are moot
same_version = pytest.mark.skipif(
    not table_matches_installed(),
    reason=f"table made from transformers {table_version()}, {transformers.__version__} installed",
)

# keys transformers sets from the load itself, not from the file's values
_NOT_VALUES = {
    "transformers_version",
    "_name_or_path",
    "dtype",
    "id2label",
    "label2id",
    "output_attentions",
}

SIZES = {
    "gpt2": {"n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 300, "n_positions": 128},
    "bert": {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 256,
             "vocab_size": 300, "max_position_embeddings": 128},
    "llama": {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 160,
              "vocab_size": 300, "max_position_embeddings": 128},
}  # fmt: skip
MOE = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
ROPE_VARIANTS = [
    {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
    {"rope_scaling": {"type": "linear", "factor": 2.0}},
    {"rope_theta": 1234.5},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 77.0}},
    {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 77.0}},
]  # fmt: skip


def _size(model_type: str) -> dict[str, object]:
    family = family_of_model_type(model_type)
    assert family is not None
    base = SIZES.get(model_type) or SIZES["bert" if family.kind == "bert" else "llama"]
    extra = {k: v for k, v in MOE.items() if family.moe}
    # the key each family's own configs use (Qwen3-MoE's num_experts is an alias of num_local_experts)
    extra.pop("num_experts" if model_type == "mixtral" else "num_local_experts", None)
    return {"model_type": model_type, **base, **extra}


def _variants(model_type: str) -> list[dict[str, object]]:
    """Hand-written configs of ``model_type`` (each a ``config.json``'s whole content)."""
    size = _size(model_type)
    out = [size, {**size, "torch_dtype": "bfloat16", "tie_word_embeddings": True}]
    if "rope_parameters" in json.loads(DEFAULTS_FILE.read_text())["model_types"][model_type]["defaults"]:
        out += [{**size, **rope} for rope in ROPE_VARIANTS]
        out += [{**size, "num_key_value_heads": 2}, {**size, "head_dim": 32}, {**size, "sliding_window": 64},
                {**size, "use_sliding_window": True, "sliding_window": 64},
                {**size, "use_sliding_window": True, "sliding_window": 4096}]  # fmt: skip
    if model_type == "gpt2":
        out += [{**size, "n_inner": 96, "activation_function": "gelu"}, {**size, "scale_attn_weights": False}]
    if model_type in ("bert", "megatron-bert"):
        out += [{**size, "hidden_act": "relu"}, {**size, "position_embedding_type": "relative_key"}]
    if model_type in ("qwen2_moe", "qwen3_moe"):
        out += [{**size, "mlp_only_layers": [1]}, {**size, "decoder_sparse_step": 2, "norm_topk_prob": True}]
    if model_type == "llama":
        out += [{**size, "eos_token_id": [2, 7]}]
    return out


def _saved(model_type: str, tmp: Path) -> dict[str, object]:
    """The ``config.json`` transformers itself writes for a tiny config of ``model_type``."""
    size = {k: v for k, v in _size(model_type).items() if k != "model_type"}
    cfg = transformers.AutoConfig.for_model(model_type, **size)
    cfg.save_pretrained(tmp)
    return json.loads((tmp / "config.json").read_text())


def _model_config(config: object, model_type: str) -> object:
    """The family converter's ``ModelConfig`` of ``config`` (or its refusal's text)."""
    family = family_of_model_type(model_type)
    assert family is not None
    module = family.module()
    try:
        if family.converter in ("llama", "moe"):
            return module.config_from_hf(config, family)
        return module.model_config_from_hf(config)
    except UserError as exc:
        return f"refused: {exc}"


def _same(ours: object, theirs: object) -> bool:
    if isinstance(theirs, float) and isinstance(ours, int | float):
        return float(ours) == theirs
    return ours == theirs


def _compare(raw: dict[str, object], tmp: Path) -> None:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(raw))
    theirs = transformers.AutoConfig.from_pretrained(str(tmp))
    ours = read_config_json(tmp)
    for key, value in theirs.to_dict().items():
        if key in _NOT_VALUES:
            continue
        assert _same(getattr(ours, key, "<missing>"), value), (
            raw,
            key,
            getattr(ours, key, "<missing>"),
            value,
        )
    for alias in type(theirs).attribute_map:
        assert getattr(ours, alias) == getattr(theirs, alias), (raw, alias)
    assert _model_config(ours, raw["model_type"]) == _model_config(theirs, raw["model_type"]), raw  # type: ignore[arg-type]


MODEL_TYPES = [f.model_type for f in families()]


@same_version
def test_the_table_is_the_installed_transformers():
    shipped = json.loads(DEFAULTS_FILE.read_text())
    generated = json.loads(json.dumps(generated_table()))
    assert shipped["model_types"] == generated["model_types"], (
        "tools/hf_config_defaults.json is stale: run python -m tools.hf_config_json"
    )


@same_version
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_saved_config_reads_as_transformers_reads_it(model_type, tmp_path):
    _compare(_saved(model_type, tmp_path / "saved"), tmp_path / "read")


@same_version
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_hand_written_configs_fill_the_class_defaults_as_transformers_does(model_type, tmp_path):
    for i, raw in enumerate(_variants(model_type)):
        _compare(raw, tmp_path / str(i))


def test_refusals_name_the_file(tmp_path):
    with pytest.raises(UserError, match="cannot read config.json"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match=r"--load .*cannot read config.json \(JSONDecodeError"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="holds a list, not a JSON object"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(UserError, match="config.json has no model_type"):
        read_config_json(tmp_path, flag="--hf-model")


def test_an_unknown_model_type_keeps_the_files_values(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "t5", "d_model": 8}')
    config = read_config_json(tmp_path)
    assert config.model_type == "t5" and config.d_model == 8
    assert getattr(config, "hidden_size", None) is None


@pytest.mark.parametrize(
    ("key", "value"), [("hidden_size", "64"), ("rms_norm_eps", "x"), ("attention_bias", 1)]
)
def test_a_value_of_the_wrong_type_is_refused_as_transformers_refuses_it(key, value, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**_size("llama"), key: value}))
    with pytest.raises(Exception):  # noqa: B017  (transformers: a strict-dataclass validation error)
        transformers.AutoConfig.from_pretrained(str(tmp_path))
    with pytest.raises(UserError, match=f"config.json: {key} must be"):
        read_config_json(tmp_path)


def test_a_model_type_outside_the_table_is_read_by_transformers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**_size("llama"), "model_type": "gptj"}))
    config = load_hf_config(tmp_path)
    assert isinstance(config, transformers.PretrainedConfig) and config.model_type == "gptj"
    llama = _written(tmp_path / "l", _size("llama"))
    assert isinstance(
        load_hf_config(llama), HFConfigJson if table_matches_installed() else transformers.PretrainedConfig
    )


def test_another_transformers_version_is_read_by_autoconfig(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_config_json, "installed_version", lambda: "0.0.0")
    config = load_hf_config(_written(tmp_path / "l", _size("llama")))
    assert isinstance(config, transformers.PretrainedConfig) and config.hidden_size == 64


def _written(where: Path, raw: dict[str, object]) -> Path:
    where.mkdir()
    (where / "config.json").write_text(json.dumps(raw))
    return where
