"""Canonical full GPT state dict <-> Hugging Face ``GPT2LMHeadModel`` (state dict and config).

A pure tensor mapping (no model code), used by ``mlm-convert to-hf`` / ``from-hf`` and tests:

* ``language_model.embedding.{word,position}_embeddings`` <-> ``transformer.{wte,wpe}``; the
  vocabulary is unpadded on both sides and may be trimmed to the tokenizer's size on export;
  ``lm_head.weight`` is tied to ``wte`` (not written; on import it must equal ``wte``).
* layer ``i``: ``input_layernorm`` <-> ``h.i.ln_1``, ``post_attention_layernorm`` <-> ``ln_2``,
  ``final_layernorm`` <-> ``ln_f``.
* HF's ``Conv1D`` stores ``[in, out]``: every linear weight is transposed. ``c_attn`` holds
  ``[q | k | v]`` column blocks, ours ``query_key_value`` rows ``[heads][3][head_dim]``.
* GeLU: ``gelu_new`` (and ``gelu_pytorch_tanh``) <-> tanh; ``gelu`` <-> erf. The LayerNorm
  epsilon, ``n_positions`` and ``n_inner`` are copied. transformers 5 has no ``attn.bias``
  buffers; older files' ``attn.bias`` / ``attn.masked_bias`` are ignored on import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pretrain.config import ModelConfig
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
    """Every one-to-one (canonical, HF, transposed) triple (QKV excluded)."""
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
    return pairs


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
    full: Mapping[str, torch.Tensor], cfg: ModelConfig, *, vocab_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Canonical full GPT tensors -> ``GPT2LMHeadModel`` state dict (without the tied lm_head).

    ``vocab_size`` trims the embedding rows to the tokenizer's size (default ``cfg.vocab_size``).
    """
    vocab = cfg.vocab_size if vocab_size is None else vocab_size
    out: dict[str, torch.Tensor] = {}
    for ours, hf, transposed in name_pairs(cfg):
        if ours not in full:
            raise UserError(f"GPT checkpoint -> Hugging Face: missing tensor {ours}")
        t = full[ours].detach()
        out[hf] = (t.t() if transposed else t).contiguous().clone()
    wte = out["transformer.wte.weight"]
    if vocab > wte.shape[0]:
        raise UserError(f"vocab size {vocab} exceeds the checkpoint's {wte.shape[0]} embedding rows")
    out["transformer.wte.weight"] = wte[:vocab].clone()
    for i in range(cfg.num_layers):
        for kind in ("weight", "bias"):
            ours, hf = _qkv(i, kind)
            out[hf] = qkv_to_c_attn(full[ours].detach(), cfg.num_attention_heads).clone()
    return out


def hf_to_canonical(hf: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``GPT2LMHeadModel`` / ``GPT2Model`` state dict -> canonical full tensors.

    Raises :class:`UserError` on missing or unexpected tensors and on an untied ``lm_head``.
    """
    hf = _strip_prefix(hf)
    pairs = name_pairs(cfg)
    qkv = [_qkv(i, kind) for i in range(cfg.num_layers) for kind in ("weight", "bias")]
    expected = {h for _, h, _ in pairs} | {h for _, h in qkv}
    given = {k for k in hf if not k.endswith(_IGNORED_SUFFIXES) and k != "lm_head.weight"}
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise UserError(
            f"Hugging Face GPT-2 -> checkpoint: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if "lm_head.weight" in hf and not torch.equal(hf["lm_head.weight"], hf["transformer.wte.weight"]):
        raise UserError("Hugging Face GPT-2: lm_head.weight differs from transformer.wte.weight (untied)")
    out = {ours: (hf[h].t() if tr else hf[h]).contiguous().clone() for ours, h, tr in pairs}
    for ours, h in qkv:
        out[ours] = c_attn_to_qkv(hf[h], cfg.num_attention_heads).clone()
    return out


def model_config_from_hf(hf_config: Any, **overrides: Any) -> ModelConfig:
    """Our :class:`ModelConfig` from a HF ``GPT2Config`` (``overrides`` win)."""
    if getattr(hf_config, "model_type", None) != "gpt2":
        raise UserError(
            f"Hugging Face config: model_type {getattr(hf_config, 'model_type', None)!r} is not 'gpt2'"
        )
    act = hf_config.activation_function
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
    kw: dict[str, Any] = dict(
        num_layers=hf_config.n_layer,
        hidden_size=hf_config.n_embd,
        num_attention_heads=hf_config.n_head,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.n_positions,
        ffn_hidden_size=hf_config.n_inner,  # None: 4h
        hidden_dropout=hf_config.resid_pdrop,
        attention_dropout=hf_config.attn_pdrop,
        layernorm_epsilon=hf_config.layer_norm_epsilon,
        init_method_std=hf_config.initializer_range,
        gelu=_HF_ACT.get(act, "erf"),
        squared_relu=squared,
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def hf_config_kwargs(
    cfg: ModelConfig, *, vocab_size: int | None = None, bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Keyword arguments for HF ``GPT2Config`` of ``cfg`` (vocab trimmed to ``vocab_size``).

    bos/eos are the tokenizer's ids, never guessed (``None`` when the tokenizer has none).
    """
    if cfg.bidirectional or cfg.post_layernorm or cfg.num_tokentypes:
        raise UserError("only GPT (causal, pre-LN, no token types) model configs export to GPT2LMHeadModel")
    vocab = cfg.vocab_size if vocab_size is None else vocab_size
    return dict(
        vocab_size=vocab,
        n_positions=cfg.max_position_embeddings,
        n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers,
        n_head=cfg.num_attention_heads,
        n_inner=None if cfg.ffn_size == 4 * cfg.hidden_size else cfg.ffn_size,
        activation_function="relu2" if cfg.squared_relu else ("gelu_new" if cfg.gelu == "tanh" else "gelu"),
        resid_pdrop=cfg.hidden_dropout,
        embd_pdrop=cfg.hidden_dropout,
        attn_pdrop=cfg.attention_dropout,
        layer_norm_epsilon=cfg.layernorm_epsilon,
        initializer_range=cfg.init_method_std,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=True,
        architectures=["GPT2LMHeadModel"],
    )
