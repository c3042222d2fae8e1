"""The one table of model options (``pretrain.model_options``): every ``ModelConfig`` field is in it
once, and every field round-trips through each direction the table derives -- Megatron ``args``
(megatron-core and legacy), ``mlm-pretrain``'s flags and each Hugging Face family's one-to-one keys."""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import pytest

from pretrain import model_option_flags as mo_flags
from pretrain import model_option_hf as mo_hf
from pretrain import model_options as mo
from pretrain.config import ModelConfig

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=100, max_position_embeddings=32)
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
             untie_embeddings_and_output_weights=True, num_query_groups=2, ffn_hidden_size=96)  # fmt: skip
CONFIGS = {
    "gpt2": ModelConfig(**BASE),
    "gpt2-erf-nodropout": ModelConfig(
        **BASE,
        gelu="erf",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=1e-6,
        init_method_std=0.01,
        ffn_hidden_size=200,
    ),  # fmt: skip
    "squared-relu-kv": ModelConfig(
        **BASE, squared_relu=True, kv_channels=16, make_vocab_size_divisible_by=64
    ),
    "llama3": ModelConfig(
        **BASE, **LLAMA, rotary_base=500000.0, use_rope_scaling=True, rope_scaling_factor=4.0
    ),
    "qwen2": ModelConfig(
        **BASE, **{**LLAMA, "untie_embeddings_and_output_weights": False}, add_qkv_bias=True
    ),
    "qwen3-partial": ModelConfig(
        **BASE, **LLAMA, qk_layernorm=True, rotary_percent=0.5, rotary_seq_len_interpolation_factor=2.0
    ),  # fmt: skip
}


def test_every_model_config_field_is_one_row() -> None:
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    rows = [o.field for o in mo.OPTIONS if o.field is not None]
    assert sorted(rows) == sorted(fields)
    megatron = [n for o in mo.OPTIONS for n in (o.megatron, *o.aliases) if n]
    assert len(megatron) == len(set(megatron)), "a Megatron name in two rows"


def test_refused_and_numerics_rows_name_megatron_fields_only() -> None:
    for option in mo.OPTIONS:
        if option.status == "refused":
            assert option.field is None and option.megatron and option.harmless
        if option.field is None:
            assert option.megatron and not option.hf and option.flag is None


@pytest.mark.parametrize("mcore", [True, False])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_megatron_args_round_trip(name: str, mcore: bool) -> None:
    cfg = CONFIGS[name]
    args = mo.args_from_config(cfg, mcore=mcore)
    read = mo.config_kwargs_from_args(args, source="ckpt")
    assert set(read) == set(mo.ARGS_FIELDS)
    for field in mo.ARGS_FIELDS:
        assert read[field] == getattr(cfg, field), field
    sizes = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings")
    assert {k: args[k] for k in sizes} == {k: getattr(cfg, k) for k in sizes}
    assert args["ffn_hidden_size"] == cfg.ffn_size


def _argv(cfg: ModelConfig) -> list[str]:
    """The ``mlm-pretrain`` flags that ask for ``cfg`` (derived from the table, as a user writes them)."""
    argv: list[str] = []
    for field in mo_flags.FLAG_FIELDS:
        flag, value = mo.BY_FIELD[field].flag, getattr(cfg, field)
        assert flag is not None
        if flag.kind == "store_true" and value or flag.kind == "store_false" and not value:
            argv.append(flag.names[0])
        elif flag.kind == "value" and value is not None:
            argv += [flag.names[0], str(value)]
    if cfg.num_query_groups is not None:
        argv += ["--group-query-attention", "--num-query-groups", str(cfg.num_query_groups)]
    return argv


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pretrain_flags_round_trip(name: str) -> None:
    cfg = CONFIGS[name]
    parser = argparse.ArgumentParser()
    mo_flags.add_model_flags(parser.add_argument_group("model"))
    read = mo_flags.config_kwargs_from_flags(parser.parse_args(_argv(cfg)))
    for field, value in read.items():
        assert value == getattr(cfg, field), field
    assert set(read) == {*mo_flags.FLAG_FIELDS, "num_query_groups"}


def test_flag_defaults_are_model_config_defaults() -> None:
    parser = argparse.ArgumentParser()
    mo_flags.add_model_flags(parser.add_argument_group("model"))
    ns = parser.parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8"])
    defaults = ModelConfig(**BASE)
    for field, value in mo_flags.config_kwargs_from_flags(ns).items():
        if field != "max_position_embeddings":  # required by ModelConfig: --seq-length stands in
            assert value == getattr(defaults, field), field


def _option_strings(parser: argparse.ArgumentParser, dest: str) -> list[str]:
    return [s for a in parser._actions if a.dest == dest for s in a.option_strings]


@pytest.mark.parametrize("command", ["sft", "glue"])
def test_finetune_commands_take_the_tables_flags_as_model_overrides(command: str) -> None:
    """``mlm-finetune sft`` and the GLUE-style tasks spell their model flags as the table does; a flag
    left out keeps the model's value (sft) or the command's documented default (GLUE: Megatron's 0.1)."""
    if command == "sft":
        from finetune.sft import cli

        parser, fields, base = cli.build_parser(), cli.MODEL_OVERRIDES, ["--hf-model", "m", "--data", "d"]
    else:
        from finetune import cli  # type: ignore[no-redef]

        parser, fields, base = (
            cli.build_parser(),
            cli.MODEL_OVERRIDES,
            ["sst2", "--hf-model", "m", "--data-dir", "d"],
        )
    for field in fields:
        flag = mo.BY_FIELD[field].flag
        assert flag is not None and _option_strings(parser, field) == list(flag.names), field
    given = mo_flags.model_overrides_from_flags(
        parser.parse_args([*base, "--hidden-dropout", "0.25"]), fields
    )
    assert given["hidden_dropout"] == 0.25
    left_out = mo_flags.model_overrides_from_flags(parser.parse_args(base), fields)
    assert left_out == ({} if command == "sft" else {"hidden_dropout": 0.1, "attention_dropout": 0.1})
    if command == "sft":
        fused = parser.parse_args([*base, "--fused-kernels"])
        assert mo_flags.model_overrides_from_flags(fused, fields) == {"fused_kernels": True}


@pytest.mark.parametrize("group", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_keys_round_trip(name: str, group: str) -> None:
    cfg = CONFIGS[name]
    written = mo_hf.hf_kwargs(cfg, group)
    assert len(written) == len({o.hf[group] for o in mo.OPTIONS if group in o.hf})
    read = mo_hf.config_kwargs_from_hf(SimpleNamespace(**written), group)
    assert read == {o.field: getattr(cfg, o.field) for o in mo.OPTIONS if o.field and group in o.hf}


def test_family_switches_and_modules_come_from_the_table() -> None:
    """The registry's switches and the converters' optional tensors are the table's columns: a
    family option (QK-norm) is named in the table, not in the registry or the converter."""
    from pretrain.models.families import families, llama

    for family in families():
        assert dict(family.switches) == mo_hf.family_switches(family.model_type), family.model_type
    assert mo_hf.family_switches("qwen3") == {"position_embedding_type": "rope", "add_qkv_bias": False,
                                           "qk_layernorm": True}  # fmt: skip
    rope = dict(
        BASE, position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False
    )
    plain, normed = ModelConfig(**rope), ModelConfig(**rope, qk_layernorm=True)
    full = ("q_full_layernorm", "k_full_layernorm")
    assert mo_hf.absent_modules(plain) == ("q_layernorm", "k_layernorm", *full)
    assert mo_hf.absent_modules(normed) == full
    assert not any("q_norm" in hf for _, hf in llama.name_pairs(plain))
    assert sum("q_norm" in hf for _, hf in llama.name_pairs(normed)) == normed.num_layers
    both = dataclasses.replace(normed, add_qkv_bias=True)
    assert llama.unsupported(both) == [
        "add_qkv_bias=True with qk_layernorm=True (no family of the Llama group (llama/mistral/qwen2/qwen3) "
        "has that combination)"
    ]
