"""Canonical full Llama-family state dict <-> Hugging Face (Llama, Mistral, Qwen2, Qwen3).

A pure name/tensor mapping (no ``transformers`` import): :data:`LAYER_TABLE` is the one table of
per-layer tensors of all four families (they share Hugging Face names), the registry
(:mod:`pretrain.models.families.registry`) what each family's config switches on. Used by ``mlm-convert to-hf`` / ``from-hf``, the upstream
Megatron readers and the parity tests.

* ``model.embed_tokens`` <-> ``language_model.embedding.word_embeddings`` (unpadded);
  ``lm_head`` <-> ``language_model.output_layer`` (untied) or absent (tied);
  ``model.norm`` <-> ``language_model.encoder.final_layernorm``.
* ``q_proj``/``k_proj``/``v_proj`` (rows ``[heads][d]``) <-> our fused ``query_key_value`` rows
  ``[groups][q heads of the group, k, v][d]`` (Megatron's GQA layout), weights and (Qwen2) biases.
* ``gate_proj`` / ``up_proj`` <-> ``dense_h_to_4h`` rows ``[gate; up]``; ``down_proj`` <->
  ``dense_4h_to_h``; ``q_norm``/``k_norm`` (Qwen3) <-> ``q_layernorm``/``k_layernorm``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from pretrain.config import ModelConfig
from pretrain.model_option_hf import absent_modules, config_kwargs_from_hf, hf_kwargs, hf_unsupported
from pretrain.models.families.converter import HFConfig, HFImport, RowPartsMaker, makers_from_row_parts
from pretrain.models.families.registry import Family, export_family, families, family_of_model_type
from pretrain.utils.buffer_pool import pooled_cat
from pretrain.utils.errors import UserError

LM = "language_model."


# (ours under "language_model.encoder.layers.{i}.", HF under "model.layers.{i}.") one-to-one.
LAYER_TABLE: tuple[tuple[str, str], ...] = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.dense.weight", "self_attn.o_proj.weight"),
    ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
    ("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
    ("mlp.dense_4h_to_h.weight", "mlp.down_proj.weight"),
)
# Fused tensors: ours -> the HF tensors it concatenates (by kind "weight" / "bias").
QKV = ("self_attention.query_key_value", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
GATE_UP = ("mlp.dense_h_to_4h", ("mlp.gate_proj", "mlp.up_proj"))
GLOBAL_TABLE: tuple[tuple[str, str], ...] = (
    (f"{LM}embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    (f"{LM}encoder.final_layernorm.weight", "model.norm.weight"),
    (f"{LM}output_layer.weight", "lm_head.weight"),
)


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, groups: int, head_dim: int
) -> torch.Tensor:
    """HF ``q [nq d, ...]``, ``k``/``v`` ``[g d, ...]`` -> rows ``[g][nq/g + 2][d]``."""
    return pooled_cat(list(qkv_rows(q, k, v, groups=groups, head_dim=head_dim)))


def qkv_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, groups: int, head_dim: int
) -> tuple[torch.Tensor, ...]:
    """The row blocks of :func:`fuse_qkv`'s tensor, in order, as views of ``q``, ``k``, ``v``:
    per group ``g`` its ``nq/g`` query heads' rows, then its key and its value head's rows."""
    per_group = q.shape[0] // groups
    out: list[torch.Tensor] = []
    for g in range(groups):
        out += [q[g * per_group : (g + 1) * per_group], k[g * head_dim : (g + 1) * head_dim],
                v[g * head_dim : (g + 1) * head_dim]]  # fmt: skip
    return tuple(out)


def split_qkv(
    qkv: torch.Tensor, *, groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    rest = qkv.shape[1:]
    x = qkv.reshape(groups, -1, head_dim, *rest)
    q = x[:, :-2].reshape(-1, *rest).contiguous()
    return q, x[:, -2].reshape(-1, *rest).contiguous(), x[:, -1].reshape(-1, *rest).contiguous()


def _layer_pairs(cfg: ModelConfig, i: int) -> list[tuple[str, str]]:
    ours, hf = f"{LM}encoder.layers.{i}.", f"model.layers.{i}."
    absent = set(absent_modules(cfg))  # e.g. the QK-norms of a model without them
    return [(ours + a, hf + b) for a, b in LAYER_TABLE if absent.isdisjoint(a.split("."))]


def name_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """Every one-to-one (canonical, HF) pair of ``cfg`` (fused QKV and gate/up excluded)."""
    pairs = [p for p in GLOBAL_TABLE if cfg.untie_embeddings_and_output_weights or "output_layer" not in p[0]]
    for i in range(cfg.num_layers):
        pairs += _layer_pairs(cfg, i)
    return pairs


def fused_names(cfg: ModelConfig) -> list[tuple[str, list[str], str]]:
    """(canonical, HF parts, "qkv" | "gate_up") of every fused tensor of ``cfg``."""
    out = []
    kinds = ("weight", "bias") if cfg.qkv_bias else ("weight",)
    for i in range(cfg.num_layers):
        ours, hf = f"{LM}encoder.layers.{i}.", f"model.layers.{i}."
        for kind in kinds:
            out.append((f"{ours}{QKV[0]}.{kind}", [f"{hf}{p}.{kind}" for p in QKV[1]], "qkv"))
        out.append((f"{ours}{GATE_UP[0]}.weight", [f"{hf}{p}.weight" for p in GATE_UP[1]], "gate_up"))
    return out


def unsupported(cfg: ModelConfig) -> list[str]:
    """The options of ``cfg`` that the Llama family (Llama, Mistral, Qwen2, Qwen3) cannot express.

    Exact: sizes, GQA, ``kv_channels`` (``head_dim``), epsilon, RoPE base and scaling, untied head,
    QKV bias (Qwen2), QK-norm (Qwen3). Refused: everything listed here (GeLU and squared ReLU
    are excluded by SwiGLU in :class:`ModelConfig`)."""
    out = hf_unsupported(cfg, "llama", "the Llama family")  # the fixed-value options (pretrain.model_options)
    out += conditions(cfg)
    if not out:  # each family fixes its switches (registry): a mix of two siblings' is none of them
        out += _unmatched_switches(dataclasses.asdict(cfg))
    return out


def conditions(cfg: ModelConfig) -> list[str]:
    """The refusals between options of the Llama attention (shared by the MoE families)."""
    if cfg.use_rope_scaling and cfg.rotary_seq_len_interpolation_factor is not None:
        return ["use_rope_scaling with rotary_seq_len_interpolation_factor (one RoPE scaling only)"]
    return []


def _unmatched_switches(values: Mapping[str, object]) -> list[str]:
    """``a=x with b=y (no family of the Llama group has both)`` when no registered family of this
    converter holds ``values``' switches (e.g. Qwen2's QKV bias with Qwen3's QK-norm)."""
    group = [f for f in families() if f.converter == "llama"]
    if any(f.holds(values) for f in group):
        return []
    keys = {k: v for f in group for k, v in f.switches.items() if values.get(k) != v}
    on = " with ".join(f"{k}={values[k]}" for k in keys)
    return [
        f"{on} (no family of the Llama group ({'/'.join(f.model_type for f in group)}) has that combination)"
    ]


def check_supported(cfg: ModelConfig) -> None:
    """Raise :class:`UserError` (one line naming each option) unless the Llama family holds ``cfg``."""
    problems = unsupported(cfg)
    if problems:
        raise UserError(
            "to-hf: the Llama family (Llama/Mistral/Qwen2/Qwen3) cannot express " + "; ".join(problems)
        )


def canonical_to_hf(full: Mapping[str, torch.Tensor], cfg: ModelConfig, *, copy: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    """Canonical full tensors -> a ``*ForCausalLM`` state dict (``lm_head`` only when untied);
    ``copy=False``: outputs may share memory with ``full``."""
    check_supported(cfg)
    out: dict[str, torch.Tensor] = {}
    for ours, hf in name_pairs(cfg):
        if ours not in full:
            raise UserError(f"checkpoint -> Hugging Face: missing tensor {ours}")
        out[hf] = _copied(full[ours].detach().contiguous(), copy)
    for ours, parts, kind in fused_names(cfg):
        if ours not in full:
            raise UserError(f"checkpoint -> Hugging Face: missing tensor {ours}")
        t = full[ours].detach()
        pieces = split_qkv(t, groups=cfg.query_groups, head_dim=cfg.head_dim) if kind == "qkv" else t.chunk(2)
        for name, piece in zip(parts, pieces, strict=True):
            out[name] = _copied(piece.contiguous(), copy)
    return out


def _copied(t: torch.Tensor, copy: bool) -> torch.Tensor:
    return t.clone() if copy else t


def lazy_hf_to_canonical(
    hf: Mapping[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, Callable[[], torch.Tensor]]:
    """A ``*ForCausalLM`` state dict -> each canonical name's maker: called, it builds that full
    tensor from its own HF tensors only (so a memory-mapped ``hf`` is read one tensor at a time).

    The names and the tied ``lm_head`` are checked now: :class:`UserError` on missing or
    unexpected tensors, or a tied ``lm_head`` in the file that differs from the embeddings.
    """
    pairs, fused = name_pairs(cfg), fused_names(cfg)
    expected = {h for _, h in pairs} | {n for _, parts, _ in fused for n in parts}
    given = {k for k in hf if not k.endswith("rotary_emb.inv_freq")}
    if not cfg.untie_embeddings_and_output_weights and "lm_head.weight" in given:
        if not torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
            raise UserError("Hugging Face model: tie_word_embeddings is set but lm_head.weight differs")
        given.discard("lm_head.weight")
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise UserError(f"Hugging Face -> checkpoint: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return makers_from_row_parts(hf_row_parts(hf, cfg))


def hf_row_parts(hf: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, RowPartsMaker]:
    """Each canonical tensor as the HF tensors' row blocks that :func:`lazy_hf_to_canonical`'s
    maker joins: views, no copy (:class:`HFImport`; the names are checked there)."""
    out: dict[str, RowPartsMaker] = {ours: functools.partial(_whole, hf[h]) for ours, h in name_pairs(cfg)}
    for ours, parts, kind in fused_names(cfg):
        ts = tuple(hf[p] for p in parts)
        if kind == "qkv":
            out[ours] = functools.partial(qkv_rows, *ts, groups=cfg.query_groups, head_dim=cfg.head_dim)
        else:
            out[ours] = functools.partial(_whole, *ts)
    return out


def _whole(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return ts


def hf_to_canonical(hf: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``*ForCausalLM`` state dict -> canonical full tensors (see :func:`lazy_hf_to_canonical`)."""
    return {name: make() for name, make in lazy_hf_to_canonical(hf, cfg).items()}


def _rope_parameters(hf_config: HFConfig) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5) or the older ``rope_theta`` + ``rope_scaling``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _rope_kwargs(hf_config: HFConfig) -> dict[str, Any]:
    p = _rope_parameters(hf_config)
    kw: dict[str, Any] = {"rotary_base": float(p["rope_theta"])}
    kind = p["rope_type"]
    if kind == "llama3":
        kw.update(
            use_rope_scaling=True,
            rope_scaling_factor=float(p["factor"]),
            rope_low_freq_factor=float(p["low_freq_factor"]),
            rope_high_freq_factor=float(p["high_freq_factor"]),
            rope_original_max_position_embeddings=int(p["original_max_position_embeddings"]),
        )
    elif kind == "linear":
        kw["rotary_seq_len_interpolation_factor"] = float(p["factor"])
    elif kind != "default":
        raise UserError(f"Hugging Face config: rope_type {kind!r} is not supported (default, llama3, linear)")
    if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError("Hugging Face config: partial_rotary_factor != 1 is not supported for this family")
    return kw


def _check_hf_config(hf_config: HFConfig) -> None:
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise UserError(f"Hugging Face config: hidden_act {act!r} is not silu")
    if getattr(hf_config, "mlp_bias", False):
        raise UserError("Hugging Face config: mlp_bias=True is not supported")
    if getattr(hf_config, "attention_bias", False):
        raise UserError("Hugging Face config: attention_bias=True (o_proj bias) is not supported")
    window = getattr(hf_config, "sliding_window", None)
    # Mistral's config has no use_sliding_window: a window it sets is used (Qwen2/3 say whether)
    uses_window = getattr(hf_config, "use_sliding_window", True)
    if uses_window and window is not None and window < hf_config.max_position_embeddings:
        raise UserError(
            f"Hugging Face config: sliding_window {window} < max_position_embeddings "
            f"{hf_config.max_position_embeddings} (sliding-window attention is not supported)"
        )


def model_config_from_hf(hf_config: HFConfig, **overrides: object) -> ModelConfig:
    """Our :class:`ModelConfig` from the HF config of a registered Llama-converter family."""
    family = family_of_model_type(getattr(hf_config, "model_type", None))
    if family is None or family.converter != "llama":
        raise UserError(
            f"Hugging Face config: model_type {getattr(hf_config, 'model_type', None)!r} is not a Llama family"
        )
    return config_from_hf(hf_config, family, **overrides)


def config_from_hf(hf_config: HFConfig, family: Family, **overrides: object) -> ModelConfig:
    """Our :class:`ModelConfig` from ``family``'s HF config (``overrides`` win); the family's switches
    (QKV bias, QK-norm) come from the registry."""
    _check_hf_config(hf_config)
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kw: dict[str, Any] = config_kwargs_from_hf(
        hf_config, "llama"
    )  # the one-to-one keys (pretrain.model_options)
    kw.update(
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        normalization="RMSNorm",
        swiglu=True,
        num_query_groups=None if kv == heads else kv,
        kv_channels=None if head_dim * heads == hf_config.hidden_size else head_dim,
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False),
        add_bias_linear=False,
        **family.switches,
        **_rope_kwargs(hf_config),
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def _rope_config(cfg: ModelConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": cfg.rotary_base, "rope_type": "default"}
    if cfg.use_rope_scaling:
        params.update(
            rope_type="llama3",
            factor=cfg.rope_scaling_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
        )
    elif cfg.rotary_seq_len_interpolation_factor is not None:
        params.update(rope_type="linear", factor=cfg.rotary_seq_len_interpolation_factor)
    return params


def family_of(cfg: ModelConfig) -> Family:
    """The registered family that holds ``cfg`` (Qwen3: QK-norm, Qwen2: QKV bias, else Llama)."""
    check_supported(cfg)
    return export_family(dataclasses.asdict(cfg), "gpt")


def hf_config_kwargs(
    cfg: ModelConfig, *, family: str | None = None, vocab_size: int | None = None,
    bos_token_id: int | None = None, eos_token_id: int | None = None,
) -> dict[str, object]:  # fmt: skip
    """Keyword arguments for the family's HF config class (``model_type`` says which)."""
    check_supported(cfg)
    fam = family_of_model_type(family) if family is not None else family_of(cfg)
    if fam is None or not fam.holds(dataclasses.asdict(cfg)):
        raise UserError(f"model -> Hugging Face {family}: QKV bias / QK-norm do not match the family")
    return {
        "model_type": fam.model_type,
        **export_config(cfg, fam, special_ids={"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}),
        "vocab_size": cfg.vocab_size if vocab_size is None else vocab_size,
    }


# --- the converter interface (pretrain.models.families.converter) ---------------------------------


def import_hf(
    state: Mapping[str, torch.Tensor], hf_config: HFConfig, family: Family, **overrides: object
) -> HFImport:
    cfg = config_from_hf(hf_config, family, **overrides)
    makers = lazy_hf_to_canonical(state, cfg)  # (checks the names first)
    return HFImport(cfg=cfg, makers=makers, row_parts=hf_row_parts(state, cfg))


def check_exportable(cfg: ModelConfig, *, family: Family | None = None) -> None:
    check_supported(cfg)


def export_config(cfg: ModelConfig, family: Family, *, special_ids: Mapping[str, int | None],
                  fresh_heads: tuple[str, ...] = ()) -> dict[str, object]:  # fmt: skip
    return {
        **hf_kwargs(cfg, "llama"),  # the one-to-one keys (pretrain.model_options)
        "architectures": [family.architecture],
        "intermediate_size": cfg.ffn_size,
        "num_key_value_heads": cfg.query_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "rope_parameters": _rope_config(cfg),
        "bos_token_id": special_ids.get("bos_token_id"),
        "eos_token_id": special_ids.get("eos_token_id"),
        "pad_token_id": special_ids.get("pad_token_id"),
        **family.hf_extra,
    }


def export_tensors(full: Mapping[str, torch.Tensor], cfg: ModelConfig, *, fresh_heads: tuple[str, ...] = (),
                   family: Family | None = None, copy: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    return canonical_to_hf(full, cfg, copy=copy)
