"""Upstream ``args`` semantics: every computation-changing field is understood or refused, in one place.

The base args are the ``vars(args)`` Megatron-LM (core_v0.16.1) produced for a Llama-style run
(tests/megatron_lm_args.json); each test sets one field.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain import model_options as sem
from pretrain.checkpoint.opener import load_canonical
from pretrain.checkpoint.plan import ModelSpec, chunk_slots
from pretrain.checkpoint.torch_dist.writer import write_torch_dist
from pretrain.checkpoint.types import DictSource
from pretrain.checkpoint.upstream.args import upstream_model_config
from pretrain.checkpoint.upstream.args_semantics import is_zero_centred_norm
from pretrain.checkpoint.upstream.names import to_mcore_key
from pretrain.config import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.utils.errors import UserError

ARGS = Path(__file__).with_name("megatron_lm_args.json")


def megatron_args(**changes: Any) -> dict[str, Any]:
    raw = json.loads(ARGS.read_text())["args"]
    args = {k: (v["__dtype__"] if isinstance(v, dict) and "__dtype__" in v else v) for k, v in raw.items()}
    args.update(padded_vocab_size=128, **changes)
    return {k: v for k, v in args.items() if v is not KeyError}


def config_of(args: dict[str, Any]) -> ModelConfig:
    probe = {"x": torch.empty(1)}
    return upstream_model_config(args, probe, kind="gpt", tp=1, vocab_size=100, num_layers=2, source="ckpt")


def test_megatron_lm_llama_args_read_as_a_llama_model() -> None:
    cfg = config_of(megatron_args())
    assert (cfg.normalization, cfg.swiglu, cfg.position_embedding_type) == ("RMSNorm", True, "rope")
    assert (cfg.query_groups, cfg.ffn_size, cfg.untie_embeddings_and_output_weights) == (2, 96, True)
    assert not cfg.add_bias_linear and not cfg.qkv_bias and cfg.gelu == "erf"


@pytest.mark.parametrize("field", sorted(sem.REFUSED))
def test_each_unimplemented_field_is_refused_naming_it(field: str) -> None:
    allowed = sem.REFUSED[field].harmless
    bad = "sliding" if isinstance(allowed[0], str) else (7 if not isinstance(allowed[0], bool) else True)
    with pytest.raises(UserError, match=rf"args\.{field}="):
        config_of(megatron_args(**{field: bad}))


# field, value, legacy model?, what the model must then compute
IMPLEMENTED = [
    ("openai_gelu", True, False, lambda c, a: c.gelu == "erf"),  # megatron-core: exact F.gelu anyway
    ("openai_gelu", True, True, lambda c, a: c.gelu == "tanh"),  # legacy models: tanh
    ("bias_gelu_fusion", True, True, lambda c, a: c.gelu == "tanh"),  # the fused kernel is tanh
    ("squared_relu", True, False, lambda c, a: c.squared_relu),
    ("apply_layernorm_1p", True, False, lambda c, a: sem.layernorm_1p(a)),
    ("layernorm_zero_centered_gamma", True, False, lambda c, a: sem.layernorm_1p(a)),
    ("qk_layernorm", True, False, lambda c, a: c.qk_layernorm),
    ("normalization", "LayerNorm", False, lambda c, a: c.normalization == "LayerNorm"),
    ("rotary_base", 500000, False, lambda c, a: c.rotary_base == 500000),
    ("rotary_percent", 0.5, False, lambda c, a: c.rotary_dim == 4),
    ("rotary_seq_len_interpolation_factor", 4, False, lambda c, a: c.rotary_seq_len_interpolation_factor == 4),
    ("use_rope_scaling", True, False, lambda c, a: c.use_rope_scaling),
    ("num_query_groups", 4, False, lambda c, a: c.query_groups == 4),
    ("kv_channels", 16, False, lambda c, a: c.head_dim == 16),
    ("untie_embeddings_and_output_weights", False, False, lambda c, a: not c.untie_embeddings_and_output_weights),
    ("add_qkv_bias", True, False, lambda c, a: c.qkv_bias and not c.add_bias_linear),
    ("layernorm_epsilon", 1e-6, False, lambda c, a: c.layernorm_epsilon == 1e-6),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value", "legacy", "check"), IMPLEMENTED)
def test_each_implemented_field_changes_the_model(field: str, value: Any, legacy: bool, check: Any) -> None:
    changes = {field: value, "use_legacy_models": legacy}
    if field == "squared_relu" or (legacy and field != "qk_layernorm"):
        changes.update(swiglu=False, add_bias_linear=True)
    args = megatron_args(**changes)
    assert check(config_of(args), args)
    assert field in MEGATRON_NAMES["implemented"]


MEGATRON_NAMES = {
    status: {n for o in sem.OPTIONS if o.status == status for n in (o.megatron, *o.aliases) if n}
    for status in ("implemented", "refused", "numerics")
}


def test_each_megatron_field_has_one_status() -> None:
    assert not MEGATRON_NAMES["implemented"] & MEGATRON_NAMES["refused"]
    assert not (MEGATRON_NAMES["implemented"] | MEGATRON_NAMES["refused"]) & MEGATRON_NAMES["numerics"]


@pytest.mark.parametrize(
    ("drop", "flag"),
    [("hidden_size", "--hidden-size"), ("num_attention_heads", "--num-attention-heads"),
     ("num_query_groups", "--num-query-groups"), ("ffn_hidden_size", "--ffn-hidden-size")],
)  # fmt: skip
def test_a_missing_needed_field_names_it_and_its_flag(drop: str, flag: str) -> None:
    args = megatron_args()
    args.pop(drop)
    with pytest.raises(UserError, match=rf"args lack {drop}.*{flag}"):
        config_of(args)


def _llama(**kw: Any) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    cfg = ModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
        vocab_size=100, max_position_embeddings=32, normalization="RMSNorm", swiglu=True,
        position_embedding_type="rope", untie_embeddings_and_output_weights=True, add_bias_linear=False, **kw,
    )  # fmt: skip
    spec = ModelSpec(kind="gpt", cfg=cfg)
    gen = torch.Generator().manual_seed(0)
    slots = chunk_slots(spec, tp=1, pre_process=True, post_process=True, layer_numbers=range(2))
    full = {
        s.canonical: torch.randn((100, *s.shape[1:]) if s.vocab else s.shape, generator=gen) for s in slots
    }
    return spec, full


def _upstream_legacy(root: Path, full: dict[str, torch.Tensor], args: dict[str, Any], minus: float) -> None:
    """A one-rank Megatron-LM legacy file with megatron-core (TE-spec) names."""
    state = {}
    for name, t in full.items():
        key, layer = to_mcore_key(name)
        key = key if layer is None else key.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)
        t = torch.cat([t, t.new_zeros(128 - 100, *t.shape[1:])]) if t.shape[0] == 100 else t
        state[key] = t - minus if is_zero_centred_norm(name) else t
    d = root / "iter_0000001" / "mp_rank_00"
    d.mkdir(parents=True)
    ns = argparse.Namespace(**args)
    torch.save(
        {"args": ns, "checkpoint_version": 3.0, "iteration": 1, "model": state}, d / "model_optim_rng.pt"
    )
    (root / "latest_checkpointed_iteration.txt").write_text("1")


def test_apply_layernorm_1p_norms_are_read_as_weight_plus_one(tmp_path: Path) -> None:
    spec, full = _llama(qk_layernorm=True)
    args = megatron_args(apply_layernorm_1p=True, qk_layernorm=True, tensor_model_parallel_size=1)
    _upstream_legacy(tmp_path / "legacy", full, args, minus=1.0)
    got, _, _ = load_canonical(tmp_path / "legacy")
    assert max((got[n] - full[n]).abs().max().item() for n in full) < 1e-6  # (w - 1) + 1: rounding only


def test_both_readers_read_qk_layernorm_the_same(tmp_path: Path) -> None:
    spec, full = _llama(qk_layernorm=True)
    _upstream_legacy(
        tmp_path / "legacy", full, megatron_args(qk_layernorm=True, tensor_model_parallel_size=1), 0
    )
    write_torch_dist(DictSource(spec=spec, full=full), tmp_path / "dist", ParallelConfig(tp=2))
    legacy, legacy_spec, _ = load_canonical(tmp_path / "legacy")
    dist, dist_spec, info = load_canonical(tmp_path / "dist")
    assert legacy_spec.cfg.qk_layernorm and dist_spec.cfg.qk_layernorm and info.format == "torch_dist"
    assert any("q_layernorm" in n for n in dist)
    assert all(torch.equal(legacy[n], full[n]) and torch.equal(dist[n], full[n]) for n in full)


GPT2 = dict(gelu="tanh")
LLAMA3 = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    rotary_base=500000.0,
    use_rope_scaling=True,
    rope_scaling_factor=8.0,
    num_query_groups=2,
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
    gelu="erf",
)
QWEN = dict(
    LLAMA3,
    use_rope_scaling=False,
    rotary_base=1e6,
    add_qkv_bias=True,
    qk_layernorm=True,
    kv_channels=32,
    layernorm_epsilon=1e-6,
)
OTHERS = dict(squared_relu=True, position_embedding_type="rope", rotary_percent=0.5,
              rotary_seq_len_interpolation_factor=4.0, gelu="erf", params_dtype="bfloat16")  # fmt: skip


@pytest.mark.parametrize("names", ["legacy", "mcore"])
@pytest.mark.parametrize("arch", [GPT2, LLAMA3, QWEN, OTHERS], ids=["gpt2", "llama3", "qwen", "others"])
def test_the_megatron_args_we_write_read_back_as_the_same_model(arch: dict[str, Any], names: str) -> None:
    """A checkpoint's Megatron-named args (``to_args``, what Megatron-LM reads) describe its model:
    read as upstream args (without our own record) they give back the very ``ModelConfig``."""
    from pretrain.checkpoint.args import build_metadata
    from pretrain.checkpoint.metadata import OURS, to_args

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, max_position_embeddings=32,
                      ffn_hidden_size=96, hidden_dropout=0.0, attention_dropout=0.0, **arch)  # fmt: skip
    meta = build_metadata(cfg, ParallelConfig(), kind="gpt", module_names=names)
    args = {k: v for k, v in vars(to_args(meta)).items() if k != OURS}
    assert config_of(args) == cfg
