"""Helpers for the mlm-convert tests: our-layout checkpoints and upstream-era rewrites of them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint.legacy.layout import MODEL_FILE, flatten
from pretrain.checkpoint.legacy.writer import DictSource, WriteOptions, write_layout
from pretrain.checkpoint.plan import ModelSpec
from pretrain.checkpoint.upstream.names import qkv_from_canonical
from pretrain.config import ModelConfig
from pretrain.parallel.config import ParallelConfig


def write_ours(
    root: Path, cfg: ModelConfig, full: dict[str, torch.Tensor], *, tp: int, pp: int, vp: int = 1,
    kind: str = "gpt", iteration: int | str = 3, module_names: str = "legacy",
) -> Path:  # fmt: skip
    """Our checkpoint of ``full`` at the given layout (legacy module names unless asked: the
    tests that edit files by key use them)."""
    spec = ModelSpec(kind=kind, cfg=cfg, add_binary_head="binary_head.weight" in full)
    write_layout(
        DictSource(spec, full),
        root,
        ParallelConfig(tp=tp, pp=pp, vp=vp),
        options=WriteOptions(iteration=iteration, module_names=module_names),
    )
    return root


def upstream_args(cfg: ModelConfig, *, tp: int, pp: int) -> argparse.Namespace:
    """An argparse Namespace with upstream Megatron-LM's flat names (no vocab_size, as upstream)."""
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_size,
        num_attention_heads=cfg.num_attention_heads, max_position_embeddings=cfg.max_position_embeddings,
        padded_vocab_size=1024, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        layernorm_epsilon=cfg.layernorm_epsilon, openai_gelu=cfg.gelu == "tanh",
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, tokenizer_type="GPT2BPETokenizer",
    )  # fmt: skip


def _legacy_key(key: str, era: str) -> str:
    if era == "old":  # checkpoint_version 0 / 1.0 era spellings
        return key.replace(".self_attention.", ".attention.")
    if era == "norm":  # newer *_norm spellings
        return key.replace("input_layernorm", "input_norm").replace("final_layernorm", "final_norm")
    return key


def rewrite_upstream(root: Path, cfg: ModelConfig, *, version: float, era: str, args: Any) -> None:
    """Turn our checkpoint under ``root`` into an upstream-era one in place.

    QKV rows reordered to ``version`` within each TP shard, ``encoder`` -> ``transformer`` and
    ``self_attention`` -> ``attention`` for ``era="old"``, ``*_norm`` names for ``era="norm"``,
    megatron-core flat names for ``era="mcore"``; ``args`` replaced by an upstream object.
    """
    for path in sorted(root.glob("iter_*/mp_rank_*/" + MODEL_FILE)):
        state = torch.load(path, weights_only=True)
        tp = state["args"].tensor_model_parallel_size  # our args: a Megatron-named Namespace
        for key in [k for k in state if k.startswith("model")]:
            state[key] = _rewrite_chunk(state[key], cfg, tp=tp, version=version, era=era)
        state["args"], state["checkpoint_version"] = args, version
        torch.save(state, path)


def _rewrite_chunk(
    chunk: dict[str, Any], cfg: ModelConfig, *, tp: int, version: float, era: str
) -> dict[str, Any]:
    heads = cfg.num_attention_heads // tp
    out: dict[str, Any] = {}
    for name, t in flatten(chunk).items():
        if "query_key_value" in name:
            t = qkv_from_canonical(t, version=version, heads=heads, head_dim=cfg.head_dim)
        if era == "mcore":
            out[_mcore_key(name)] = t
            continue
        parts = name.split(".")
        if parts[0] == "language_model" and parts[1] == "encoder":
            sub = "transformer" if era == "old" else "encoder"
            out.setdefault("language_model", {}).setdefault(sub, {})[
                _legacy_key(".".join(parts[2:]), era)
            ] = t
        elif parts[0] == "language_model":
            out.setdefault("language_model", {}).setdefault(parts[1], {}).setdefault(parts[2], {})[
                parts[3]
            ] = t
        else:
            out.setdefault(parts[0], {})[".".join(parts[1:])] = t
    return out


_MCORE = [
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    ("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias"),
    ("self_attention.query_key_value", "self_attention.linear_qkv"),
    ("self_attention.dense", "self_attention.linear_proj"),
    ("post_attention_layernorm", "pre_mlp_layernorm"),
    ("mlp.dense_h_to_4h", "mlp.linear_fc1"),
    ("mlp.dense_4h_to_h", "mlp.linear_fc2"),
]


def _mcore_key(name: str) -> str:
    if name.startswith("language_model.encoder.layers."):
        rest = name[len("language_model.encoder.") :]
        for old, new in _MCORE:
            rest = rest.replace(old, new)
        return "decoder." + rest
    if name.startswith("language_model.encoder.final_layernorm"):
        return name.replace("language_model.encoder.", "decoder.")
    if name.startswith("word_embeddings_for_head"):
        return "output_layer.weight"
    return name.replace("language_model.", "")


BF16_LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                  num_query_groups=2, untie_embeddings_and_output_weights=True, params_dtype="bfloat16")  # fmt: skip


def write_bf16_llama_torch_dist(root: Path, *, tp: int, pp: int) -> dict[str, torch.Tensor]:
    """A tiny 4-layer bf16 Llama (GQA, untied head) as a ``torch_dist`` checkpoint at ``root``
    written at tp/pp; its full tensors."""
    from pretrain.checkpoint.torch_dist.writer import write_torch_dist
    from tests.gpt_fixtures import full_weights, tiny_config

    cfg = tiny_config(num_layers=4, **BF16_LLAMA)  # type: ignore[arg-type]
    full = {k: v.bfloat16() for k, v in full_weights(cfg).items()}
    write_torch_dist(DictSource(ModelSpec(kind="gpt", cfg=cfg), full), root, ParallelConfig(tp=tp, pp=pp))
    return full
