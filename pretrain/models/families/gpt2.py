"""Canonical full GPT state dict <-> Hugging Face ``GPT2LMHeadModel`` (state dict and config).

A pure tensor mapping (no model code), used by ``mlm-convert to-hf`` / ``from-hf`` and tests:

* ``language_model.embedding.{word,position}_embeddings`` <-> ``transformer.{wte,wpe}``; the
  vocabulary is unpadded on both sides and may be trimmed to the tokenizer's size on export;
  ``lm_head.weight`` is tied to ``wte`` (not written), or with
  ``untie_embeddings_and_output_weights`` <-> ``language_model.output_layer`` (``tie_word_embeddings``
  false); on import an ``lm_head`` equal to ``wte`` is the tied one.
* GPT-2 always has linear biases: a checkpoint without them (``--disable-bias-linear``; QKV bias
  kept with ``add_qkv_bias``) is written with zero biases, which computes the same function.
* Everything else GPT-2 lacks is refused by :func:`check_exportable` with one line naming the
  option (QK-norm, RMSNorm, SwiGLU, GQA, ``kv_channels`` other than ``hidden/heads``, RoPE, ...).
* layer ``i``: ``input_layernorm`` <-> ``h.i.ln_1``, ``post_attention_layernorm`` <-> ``ln_2``,
  ``final_layernorm`` <-> ``ln_f``.
* HF's ``Conv1D`` stores ``[in, out]``: every linear weight is transposed. ``c_attn`` holds
  ``[q | k | v]`` column blocks, ours ``query_key_value`` rows ``[heads][3][head_dim]``.
* GeLU: ``gelu_new`` (and ``gelu_pytorch_tanh``) <-> tanh; ``gelu`` <-> erf. The LayerNorm
  epsilon, ``n_positions`` and ``n_inner`` are copied. transformers 5 has no ``attn.bias``
  buffers; older files' ``attn.bias`` / ``attn.masked_bias`` are ignored on import.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from pretrain.config import ModelConfig
from pretrain.model_option_hf import config_kwargs_from_hf, hf_kwargs, hf_unsupported
from pretrain.models.families.converter import HFConfig, HFImport
from pretrain.models.families.registry import Family
from pretrain.utils.errors import UserError

LM = "language_model."
_HF_ACT = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "erf"}
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def _layer_pairs(i: int) -> list[tuple[str, str, bool]]:
    """(canonical, HF, transposed) of layer ``i`` except the fused QKV."""
    ours, hf = f"{LM}encoder.layers.{i}.", f"transformer.h.{i}."
    out = []
    for a, b, linear in (
        ("input_layernorm", "ln_1", False),
        ("self_attention.dense", "attn.c_proj", True),
        ("post_attention_layernorm", "ln_2", False),
        ("mlp.dense_h_to_4h", "mlp.c_fc", True),
        ("mlp.dense_4h_to_h", "mlp.c_proj", True),
    ):
        out.append((f"{ours}{a}.weight", f"{hf}{b}.weight", linear))
        out.append((f"{ours}{a}.bias", f"{hf}{b}.bias", False))
    return out


def name_pairs(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """Every one-to-one (canonical, HF, transposed) triple (QKV excluded; the untied head included)."""
    pairs = [
        (f"{LM}embedding.word_embeddings.weight", "transformer.wte.weight", False),
        (f"{LM}embedding.position_embeddings.weight", "transformer.wpe.weight", False),
    ]
    for i in range(cfg.num_layers):
        pairs += _layer_pairs(i)
    pairs += [
        (f"{LM}encoder.final_layernorm.weight", "transformer.ln_f.weight", False),
        (f"{LM}encoder.final_layernorm.bias", "transformer.ln_f.bias", False),
    ]
    if cfg.untie_embeddings_and_output_weights:
        pairs.append((f"{LM}output_layer.weight", "lm_head.weight", False))
    return pairs


def unsupported(cfg: ModelConfig) -> list[str]:
    """The options of ``cfg`` that ``GPT2LMHeadModel`` cannot express (empty: exportable).

    Every :class:`ModelConfig` field is exact (sizes, epsilon, GeLU kind, squared ReLU as
    ``relu2``, dropout, init std), writable (untied head, missing linear biases as zeros) or listed
    here. Rotary fields only matter with RoPE, which is listed itself."""
    out = hf_unsupported(cfg, "gpt2", "GPT-2")  # the fixed-value options (pretrain.model_options)
    if cfg.query_groups != cfg.num_attention_heads:
        out.append(f"num_query_groups={cfg.query_groups} (GPT-2 has no grouped-query attention)")
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        out.append(
            f"kv_channels={cfg.head_dim} with hidden_size {cfg.hidden_size} and {cfg.num_attention_heads} heads "
            "(GPT-2's head size is n_embd/n_head)"
        )
    return out


def check_exportable(cfg: ModelConfig, *, family: Family | None = None) -> None:
    """Raise :class:`UserError` (one line naming each option) unless GPT-2 holds ``cfg`` exactly."""
    problems = unsupported(cfg)
    if problems:
        llama_like = cfg.swiglu or cfg.normalization == "RMSNorm"
        hint = " (the Llama-family export needs position_embedding_type=rope)" if llama_like else ""
        raise UserError("to-hf: GPT2LMHeadModel cannot express " + "; ".join(problems) + hint)


def _qkv(i: int, kind: str) -> tuple[str, str]:
    return (
        f"{LM}encoder.layers.{i}.self_attention.query_key_value.{kind}",
        f"transformer.h.{i}.attn.c_attn.{kind}",
    )


def qkv_to_c_attn(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """Our ``[3h(, h)]`` rows ``[heads][3][hd]`` -> HF ``c_attn`` (``[h, 3h]`` weight, ``[3h]`` bias)."""
    three_h, rest = qkv.shape[0], qkv.shape[1:]
    x = qkv.reshape(heads, 3, three_h // (3 * heads), *rest).transpose(0, 1).reshape(three_h, *rest)
    return x.t().contiguous() if x.dim() == 2 else x.contiguous()


def c_attn_to_qkv(c_attn: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`qkv_to_c_attn`."""
    x = c_attn.t() if c_attn.dim() == 2 else c_attn
    three_h, rest = x.shape[0], x.shape[1:]
    x = x.reshape(3, heads, three_h // (3 * heads), *rest).transpose(0, 1)
    return x.reshape(three_h, *rest).contiguous()


def _strip_prefix(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept ``GPT2Model`` keys (no ``transformer.`` prefix) as well as ``GPT2LMHeadModel``'s."""
    if any(k.startswith("transformer.") for k in hf):
        return dict(hf)
    return {(k if k.startswith("lm_head.") else f"transformer.{k}"): v for k, v in hf.items()}


def canonical_to_hf(
    full: Mapping[str, torch.Tensor], cfg: ModelConfig, *, vocab_size: int | None = None, copy: bool = True
) -> dict[str, torch.Tensor]:
    """Canonical full GPT tensors -> ``GPT2LMHeadModel`` state dict (``lm_head`` only when untied).

    ``vocab_size`` trims the vocabulary rows to the tokenizer's size (default ``cfg.vocab_size``).
    Linear biases the checkpoint lacks (``add_bias_linear=False``) are written as zeros.
    """
    check_exportable(cfg)
    vocab = cfg.vocab_size if vocab_size is None else vocab_size
    out: dict[str, torch.Tensor] = {}
    for ours, hf, transposed in name_pairs(cfg):
        if ours not in full and ours.endswith(".bias") and _zero_bias_allowed(ours, cfg):
            weight = full[ours.removesuffix("bias") + "weight"]  # same device: meta stays meta
            out[hf] = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)
            continue
        if ours not in full:
            raise UserError(f"GPT checkpoint -> Hugging Face: missing tensor {ours}")
        t = full[ours].detach()
        t = (t.t() if transposed else t).contiguous()
        out[hf] = t.clone() if copy else t  # copy=False: may share memory with ``full``
    for hf in ("transformer.wte.weight", "lm_head.weight"):
        if hf in out:
            if vocab > out[hf].shape[0]:
                raise UserError(
                    f"vocab size {vocab} exceeds the checkpoint's {out[hf].shape[0]} rows of {hf}"
                )
            out[hf] = out[hf][:vocab].clone()
    for i in range(cfg.num_layers):
        for kind in ("weight", "bias"):
            ours, hf = _qkv(i, kind)
            if kind == "bias" and not cfg.qkv_bias:
                weight = full[_qkv(i, "weight")[0]]
                t = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)
            else:
                t = full[ours].detach()
            out[hf] = qkv_to_c_attn(t, cfg.num_attention_heads).clone()
    return out


def _zero_bias_allowed(name: str, cfg: ModelConfig) -> bool:
    """Whether a missing canonical bias is one ``--disable-bias-linear`` removed (GPT-2 needs zeros)."""
    return not cfg.add_bias_linear and ".layers." in name and (".self_attention." in name or ".mlp." in name)


def lazy_hf_to_canonical(
    hf: Mapping[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, Callable[[], torch.Tensor]]:
    """A ``GPT2LMHeadModel`` / ``GPT2Model`` state dict -> each canonical name's maker (builds
    that full tensor from its own HF tensor only when called).

    Raises :class:`UserError` now on missing or unexpected tensors; with a tied ``cfg`` an
    ``lm_head`` in the file must equal ``wte``.
    """
    hf = _strip_prefix(hf)
    pairs = name_pairs(cfg)
    qkv = [_qkv(i, kind) for i in range(cfg.num_layers) for kind in ("weight", "bias")]
    expected = {h for _, h, _ in pairs} | {h for _, h in qkv}
    tied = not cfg.untie_embeddings_and_output_weights
    given = {k for k in hf if not k.endswith(_IGNORED_SUFFIXES) and not (tied and k == "lm_head.weight")}
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise UserError(
            f"Hugging Face GPT-2 -> checkpoint: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if (
        tied
        and "lm_head.weight" in hf
        and not torch.equal(hf["lm_head.weight"], hf["transformer.wte.weight"])
    ):
        raise UserError(
            "Hugging Face GPT-2: tie_word_embeddings is set but lm_head.weight differs from transformer.wte.weight"
        )
    out: dict[str, Callable[[], torch.Tensor]] = {
        ours: functools.partial(_copy, hf[h], transposed=tr) for ours, h, tr in pairs
    }
    for ours, h in qkv:
        out[ours] = functools.partial(_qkv_copy, hf[h], cfg.num_attention_heads)
    return out


def _copy(t: torch.Tensor, *, transposed: bool) -> torch.Tensor:
    return (t.t() if transposed else t).contiguous().clone()


def _qkv_copy(c_attn: torch.Tensor, heads: int) -> torch.Tensor:
    return c_attn_to_qkv(c_attn, heads).clone()


def hf_to_canonical(hf: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``GPT2LMHeadModel`` / ``GPT2Model`` state dict -> canonical full tensors (see
    :func:`lazy_hf_to_canonical`)."""
    return {name: make() for name, make in lazy_hf_to_canonical(hf, cfg).items()}


def model_config_from_hf(hf_config: HFConfig, **overrides: object) -> ModelConfig:
    """Our :class:`ModelConfig` from a HF ``GPT2Config`` (``overrides`` win)."""
    if getattr(hf_config, "model_type", None) != "gpt2":
        raise UserError(
            f"Hugging Face config: model_type {getattr(hf_config, 'model_type', None)!r} is not 'gpt2'"
        )
    act = getattr(hf_config, "activation_function", "gelu_new")
    squared = act == "relu2"  # Megatron --squared-relu
    if act not in _HF_ACT and not squared:
        raise UserError(
            f"Hugging Face config: activation_function {act!r} is not one of {', '.join(_HF_ACT)}"
        )
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if getattr(hf_config, flag, False):
            raise UserError(f"Hugging Face config: {flag}=True is not supported")
    if not getattr(hf_config, "scale_attn_weights", True):
        raise UserError("Hugging Face config: scale_attn_weights=False is not supported")
    kw: dict[str, Any] = config_kwargs_from_hf(
        hf_config, "gpt2"
    )  # the one-to-one keys (pretrain.model_options)
    kw.update(
        ffn_hidden_size=getattr(hf_config, "n_inner", None),  # None: 4h
        gelu=_HF_ACT.get(act, "erf"),
        squared_relu=squared,
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", True),
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def hf_config_kwargs(
    cfg: ModelConfig, *, vocab_size: int | None = None, bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> dict[str, object]:  # fmt: skip
    """Keyword arguments for HF ``GPT2Config`` of ``cfg`` (vocab trimmed to ``vocab_size``).

    bos/eos are the tokenizer's ids, never guessed (``None`` when the tokenizer has none).
    """
    check_exportable(cfg)
    return {
        **hf_kwargs(cfg, "gpt2"),  # the one-to-one keys (pretrain.model_options)
        "vocab_size": cfg.vocab_size if vocab_size is None else vocab_size,
        "n_inner": None if cfg.ffn_size == 4 * cfg.hidden_size else cfg.ffn_size,
        "activation_function": "relu2"
        if cfg.squared_relu
        else ("gelu_new" if cfg.gelu == "tanh" else "gelu"),
        "embd_pdrop": cfg.hidden_dropout,
    } | dict(
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
        architectures=["GPT2LMHeadModel"],
    )


# --- the converter interface (pretrain.models.families.converter) ---------------------------------


def import_hf(
    state: Mapping[str, torch.Tensor], hf_config: HFConfig, family: Family, **overrides: object
) -> HFImport:
    cfg = model_config_from_hf(hf_config, **overrides)
    return HFImport(cfg=cfg, makers=lazy_hf_to_canonical(state, cfg))


def export_config(cfg: ModelConfig, family: Family, *, special_ids: Mapping[str, int | None],
                  fresh_heads: tuple[str, ...] = ()) -> dict[str, object]:  # fmt: skip
    kw = hf_config_kwargs(cfg, bos_token_id=special_ids.get("bos_token_id"),
                          eos_token_id=special_ids.get("eos_token_id"))  # fmt: skip
    return {**kw, "architectures": [family.architecture], "pad_token_id": special_ids.get("pad_token_id"),
            **family.hf_extra}  # fmt: skip


def export_tensors(full: Mapping[str, torch.Tensor], cfg: ModelConfig, *, fresh_heads: tuple[str, ...] = (),
                   family: Family | None = None, copy: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    return canonical_to_hf(full, cfg, copy=copy)
