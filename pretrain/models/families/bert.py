"""Canonical full BERT state dict <-> Hugging Face ``BertForPreTraining`` / ``MegatronBertForPreTraining``.

A pure tensor mapping (no model code), used by tests and ``mlm-convert``:

* post-LN (``cfg.post_layernorm``, original BERT) <-> ``BertForPreTraining``: ``embeddings.LayerNorm``
  -> ``embedding.layernorm``; ``attention.output.LayerNorm`` -> ``post_attention_layernorm``;
  ``output.LayerNorm`` -> ``post_mlp_layernorm``; no final LayerNorm.
* pre-LN (Megatron's default) <-> ``MegatronBertForPreTraining``: ``attention.ln`` ->
  ``input_layernorm``; ``ln`` -> ``post_attention_layernorm``; ``encoder.ln`` ->
  ``final_layernorm``; no embedding LayerNorm.
* Both: HF's separate query/key/value ``[h, h]`` become our fused ``query_key_value [3h, h]`` with
  rows ordered ``[heads][3][head_dim]``; ``cls.predictions.transform.{dense,LayerNorm}`` ->
  ``lm_head.{dense,layernorm}``; ``cls.predictions.bias`` -> ``lm_head.bias``;
  ``cls.seq_relationship`` -> ``binary_head``; ``bert.pooler.dense`` -> ``language_model.pooler.dense``.
  Without pooler and binary head the same names serve ``Bert(MegatronBert)ForMaskedLM``.

A bare ``BertModel`` / ``MegatronBertModel`` (encoder + pooler, no ``cls.*`` heads) imports with
``lm_head=False``; our ``BertModel`` always has an LM head, so :func:`add_fresh_heads` initialises
the missing heads (LM head; binary head beside a pooler) and names them. Checkpoints record those
names (``args.mlm_toolkit.fresh_heads``) and export back to the bare architecture without them.

HF's ``cls.predictions.decoder.{weight,bias}`` are tied to the word embeddings and to
``cls.predictions.bias``: they are written as copies and, on import, must equal their tie.
Vocabulary tensors are unpadded ``[vocab_size, ...]`` on both sides.

Export is exact or refused (:func:`check_exportable`): layer biases a checkpoint lacks
(``add_bias_linear=False``) are written as zeros, a model without token types gets one zero
token-type row, squared ReLU is HF's ``relu2``; RMSNorm, SwiGLU, RoPE, GQA, ``kv_channels`` other
than ``hidden/heads``, QK-norm and an untied output layer are refused, naming the option.
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
_HF_ACT = {"gelu": "erf", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # relu2: squared ReLU
_TIED = {  # HF key -> the HF key it is tied to
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}
_IGNORED_HF = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")


def hf_architecture(cfg: ModelConfig, *, bare: bool = False) -> str:
    """``BertForPreTraining`` for post-LN configs, ``MegatronBertForPreTraining`` for pre-LN
    (``BertModel`` / ``MegatronBertModel`` when ``bare``)."""
    suffix = "Model" if bare else "ForPreTraining"
    return ("Bert" if cfg.post_layernorm else "MegatronBert") + suffix


def _pairs(a: str, b: str) -> list[tuple[str, str]]:
    return [(f"{a}.weight", f"{b}.weight"), (f"{a}.bias", f"{b}.bias")]


def _layer_pairs(cfg: ModelConfig, i: int) -> list[tuple[str, str]]:
    """(canonical, HF) names of layer ``i`` except the fused QKV."""
    ours, hf = f"{LM}encoder.layers.{i}.", f"bert.encoder.layer.{i}."
    pairs = _pairs(ours + "self_attention.dense", hf + "attention.output.dense")
    pairs += _pairs(ours + "mlp.dense_h_to_4h", hf + "intermediate.dense")
    pairs += _pairs(ours + "mlp.dense_4h_to_h", hf + "output.dense")
    if cfg.post_layernorm:
        pairs += _pairs(ours + "post_attention_layernorm", hf + "attention.output.LayerNorm")
        pairs += _pairs(ours + "post_mlp_layernorm", hf + "output.LayerNorm")
    else:
        pairs += _pairs(ours + "input_layernorm", hf + "attention.ln")
        pairs += _pairs(ours + "post_attention_layernorm", hf + "ln")
    return pairs


def name_pairs(
    cfg: ModelConfig, *, binary_head: bool = True, lm_head: bool = True, pooler: bool | None = None
) -> list[tuple[str, str]]:
    """Every one-to-one (canonical name, HF name) pair of the architecture (QKV and ties excluded).

    ``pooler`` defaults to ``binary_head`` (HF's pre-training model has both or neither)."""
    emb = f"{LM}embedding."
    pairs = [
        (emb + "word_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
        (emb + "position_embeddings.weight", "bert.embeddings.position_embeddings.weight"),
        (emb + "tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight"),
    ]
    if cfg.post_layernorm:
        pairs += _pairs(emb + "layernorm", "bert.embeddings.LayerNorm")
    for i in range(cfg.num_layers):
        pairs += _layer_pairs(cfg, i)
    if not cfg.post_layernorm:
        pairs += _pairs(f"{LM}encoder.final_layernorm", "bert.encoder.ln")
    if lm_head:
        pairs += _pairs("lm_head.dense", "cls.predictions.transform.dense")
        pairs += _pairs("lm_head.layernorm", "cls.predictions.transform.LayerNorm")
        pairs.append(("lm_head.bias", "cls.predictions.bias"))
    if binary_head if pooler is None else pooler:
        pairs += _pairs(f"{LM}pooler.dense", "bert.pooler.dense")
    if binary_head:
        pairs += _pairs("binary_head", "cls.seq_relationship")
    return pairs


def _qkv_names(i: int, kind: str) -> tuple[str, list[str]]:
    hf = f"bert.encoder.layer.{i}.attention.self."
    ours = f"{LM}encoder.layers.{i}.self_attention.query_key_value.{kind}"
    return ours, [f"{hf}{p}.{kind}" for p in ("query", "key", "value")]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Separate ``[h, ...]`` q/k/v -> fused ``[3h, ...]`` with rows ``[heads][3][head_dim]``."""
    parts = [t.reshape(heads, t.shape[0] // heads, *t.shape[1:]) for t in (q, k, v)]
    return torch.stack(parts, dim=1).reshape(3 * q.shape[0], *q.shape[1:]).clone()


def split_qkv(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: fused ``[3h, ...]`` -> q, k, v ``[h, ...]``."""
    h = qkv.shape[0] // 3
    grouped = qkv.reshape(heads, 3, h // heads, *qkv.shape[1:])
    q, k, v = (grouped[:, j].reshape(h, *qkv.shape[1:]).clone() for j in range(3))
    return q, k, v


def _check_keys(what: str, given: Mapping[str, Any], expected: set[str], ignored: tuple[str, ...]) -> None:
    missing = sorted(expected - set(given))
    unexpected = sorted(set(given) - expected - set(ignored))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:8])}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {', '.join(unexpected[:8])}")
        raise UserError(f"{what}: {'; '.join(parts)}")


def unsupported(cfg: ModelConfig) -> list[str]:
    """The options of ``cfg`` that HF's BERT / MegatronBERT cannot express (empty: exportable)."""
    out = hf_unsupported(cfg, "bert", "BERT")  # the fixed-value options (pretrain.model_options)
    if cfg.query_groups != cfg.num_attention_heads:
        out.append(f"num_query_groups={cfg.query_groups} (BERT has no grouped-query attention)")
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        out.append(f"kv_channels={cfg.head_dim} with hidden_size {cfg.hidden_size} and "
                   f"{cfg.num_attention_heads} heads (BERT's head size is hidden/heads)")  # fmt: skip
    return out


def check_exportable(cfg: ModelConfig, *, family: Family | None = None) -> None:
    """Raise :class:`UserError` (one line naming each option) unless HF BERT holds ``cfg`` exactly."""
    problems = unsupported(cfg)
    if problems:
        raise UserError(f"to-hf: {hf_architecture(cfg)} cannot express " + "; ".join(problems))


def _with_written_zeros(full: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``full`` plus the zeros HF BERT needs where the checkpoint has none: layer biases
    (``add_bias_linear=False``; the QKV bias unless ``add_qkv_bias``) and, without token types, one
    token-type row. Zeros take their weight's device, so ``meta`` stays ``meta`` when streaming."""
    out = dict(full)

    def zeros_like_rows(weight: str, *shape: int) -> torch.Tensor:
        w = out[weight]
        return torch.zeros(*(shape or (w.shape[0],)), dtype=w.dtype, device=w.device)

    for i in range(cfg.num_layers):
        pre = f"{LM}encoder.layers.{i}."
        for part in ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h",
                     "mlp.dense_4h_to_h"):  # fmt: skip
            if f"{pre}{part}.bias" not in out and f"{pre}{part}.weight" in out:
                keep = cfg.qkv_bias if part.endswith("query_key_value") else cfg.add_bias_linear
                if not keep:
                    out[f"{pre}{part}.bias"] = zeros_like_rows(f"{pre}{part}.weight")
    types, words = f"{LM}embedding.tokentype_embeddings.weight", f"{LM}embedding.word_embeddings.weight"
    if cfg.num_tokentypes == 0 and types not in out and words in out:
        out[types] = zeros_like_rows(words, 1, cfg.hidden_size)
    return out


def canonical_to_hf(
    full: Mapping[str, torch.Tensor], cfg: ModelConfig, *, include_tied: bool = True,
    fresh_heads: tuple[str, ...] = (), copy: bool = True,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Canonical full BERT tensors -> the state dict of :func:`hf_architecture` (``cfg``).

    The binary head (pooler + ``cls.seq_relationship``) is exported when present in ``full``.
    ``include_tied`` adds the tied ``cls.predictions.decoder.*`` copies (``load_state_dict``
    with ``strict=True`` expects them; safetensors writers usually drop them). Heads named in
    ``fresh_heads`` (see :func:`add_fresh_heads`) are left out; without the LM head the state dict
    is a bare ``(Megatron)BertModel``'s (no ``bert.`` prefix).
    """
    check_exportable(cfg)
    full = _with_written_zeros(full, cfg)
    bare = "lm_head" in fresh_heads
    pooler = f"{LM}pooler.dense.weight" in full
    binary = "binary_head.weight" in full and "binary_head" not in fresh_heads
    pairs = name_pairs(cfg, binary_head=binary, lm_head=not bare, pooler=pooler)
    qkv = [_qkv_names(i, kind) for i in range(cfg.num_layers) for kind in ("weight", "bias")]
    fresh = {n for n in full if n.split(".")[0] in fresh_heads}
    expected = {o for o, _ in pairs} | {o for o, _ in qkv} | fresh
    _check_keys("BERT checkpoint -> Hugging Face", full, expected, ())
    out = {hf: full[ours].detach().clone() if copy else full[ours].detach() for ours, hf in pairs}
    for ours, hf_names in qkv:
        for name, t in zip(hf_names, split_qkv(full[ours].detach(), cfg.num_attention_heads)):
            out[name] = t
    if bare:
        return {k.removeprefix("bert."): v for k, v in out.items()}
    if include_tied:
        for key, tie in _TIED.items():
            out[key] = out[tie].clone()
    return out


def add_fresh_heads(full: dict[str, torch.Tensor], cfg: ModelConfig, *, seed: int = 0) -> tuple[str, ...]:
    """Initialise (in place, as our model would) the heads a bare HF model lacks: the LM head, and
    the binary head when a pooler is present (our model keeps the pooler only with it). Returns
    the names of the heads added (``"lm_head"``, ``"binary_head"``)."""
    gen = torch.Generator().manual_seed(seed)
    h, std, added = cfg.hidden_size, cfg.init_method_std, []
    if "lm_head.bias" not in full:
        full["lm_head.dense.weight"] = torch.randn(h, h, generator=gen) * std
        full["lm_head.dense.bias"] = torch.zeros(h)
        full["lm_head.layernorm.weight"] = torch.ones(h)
        full["lm_head.layernorm.bias"] = torch.zeros(h)
        full["lm_head.bias"] = torch.zeros(cfg.vocab_size)
        added.append("lm_head")
    if f"{LM}pooler.dense.weight" in full and "binary_head.weight" not in full:
        full["binary_head.weight"] = torch.randn(2, h, generator=gen) * std
        full["binary_head.bias"] = torch.zeros(2)
        added.append("binary_head")
    return tuple(added)


def lazy_hf_to_canonical(
    hf: Mapping[str, torch.Tensor], cfg: ModelConfig, *, lm_head: bool = True
) -> dict[str, Callable[[], torch.Tensor]]:
    """A ``BertForPreTraining`` (post-LN ``cfg``) or ``MegatronBertForPreTraining`` (pre-LN) state
    dict -> each canonical name's maker (builds that full tensor from its own HF tensors only when
    called). ``*ForMaskedLM`` state dicts (no pooler or ``cls.seq_relationship``) give a model
    without the binary head. ``lm_head=False`` reads a bare ``(Megatron)BertModel`` (keys prefixed
    ``bert.``; no ``cls.*``; pooler optional) and returns no heads (see :func:`add_fresh_heads`).
    Raises :class:`UserError` now on missing or unexpected tensors, and on an untied decoder."""
    binary = "cls.seq_relationship.weight" in hf
    pooler = binary or (not lm_head and "bert.pooler.dense.weight" in hf)
    pairs = name_pairs(cfg, binary_head=binary, lm_head=lm_head, pooler=pooler)
    qkv = [_qkv_names(i, kind) for i in range(cfg.num_layers) for kind in ("weight", "bias")]
    expected = {h for _, h in pairs} | {n for _, names in qkv for n in names}
    what = f"Hugging Face {hf_architecture(cfg, bare=not lm_head)} -> BERT checkpoint"
    _check_keys(what, hf, expected, (*_IGNORED_HF, *_TIED))
    for key, tie in _TIED.items():
        if key in hf and not torch.equal(hf[key], hf[tie]):
            raise UserError(f"{what}: {key} differs from {tie}; only a tied decoder can be imported")
    out: dict[str, Callable[[], torch.Tensor]] = {
        ours: functools.partial(_copy, hf[name]) for ours, name in pairs
    }
    for ours, hf_names in qkv:
        q, k, v = (hf[n].detach() for n in hf_names)
        out[ours] = functools.partial(fuse_qkv, q, k, v, cfg.num_attention_heads)
    return out


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def hf_to_canonical(
    hf: Mapping[str, torch.Tensor], cfg: ModelConfig, *, lm_head: bool = True
) -> dict[str, torch.Tensor]:
    """A BERT state dict -> canonical full tensors (see :func:`lazy_hf_to_canonical`)."""
    return {name: make() for name, make in lazy_hf_to_canonical(hf, cfg, lm_head=lm_head).items()}


def model_config_from_hf(hf_config: HFConfig, **overrides: object) -> ModelConfig:
    """Our :class:`ModelConfig` from a HF ``BertConfig`` (post-LN) or ``MegatronBertConfig`` (pre-LN).

    Copies ``layer_norm_eps``; ``hidden_act`` ``gelu`` -> erf GeLU, ``gelu_new`` /
    ``gelu_pytorch_tanh`` -> tanh. ``overrides`` (e.g. ``make_vocab_size_divisible_by``) win.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in ("bert", "megatron-bert"):
        raise UserError(f"Hugging Face config: model_type {model_type!r} is not 'bert' or 'megatron-bert'")
    act = getattr(hf_config, "hidden_act", None)
    if act not in _HF_ACT and act != "relu2":
        raise UserError(f"Hugging Face config: hidden_act {act!r} is not one of {', '.join(_HF_ACT)}")
    pos = getattr(hf_config, "position_embedding_type", "absolute")
    if pos not in (None, "absolute"):
        raise UserError(
            f"Hugging Face config: position_embedding_type {pos!r} is not supported (absolute only)"
        )
    kw: dict[str, Any] = config_kwargs_from_hf(
        hf_config, "bert"
    )  # the one-to-one keys (pretrain.model_options)
    kw.update(
        gelu=_HF_ACT.get(act, "erf"),
        squared_relu=act == "relu2",
        bidirectional=True,
        post_layernorm=model_type == "bert",
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, object]:
    """Keyword arguments for HF ``BertConfig`` (post-LN) / ``MegatronBertConfig`` (pre-LN) of ``cfg``."""
    check_exportable(cfg)
    act = "relu2" if cfg.squared_relu else "gelu" if cfg.gelu == "erf" else "gelu_new"
    return {
        **hf_kwargs(cfg, "bert"),  # the one-to-one keys (pretrain.model_options)
        "intermediate_size": cfg.ffn_size,
        "hidden_act": act,
        "type_vocab_size": max(cfg.num_tokentypes, 1),  # none: one zero row (see _with_written_zeros)
    }


# --- the converter interface (pretrain.models.families.converter) ---------------------------------


def import_hf(
    state: Mapping[str, torch.Tensor], hf_config: HFConfig, family: Family, **overrides: object
) -> HFImport:
    """A (Megatron)BERT, pretraining heads or bare: our BertModel always has an LM head, so a bare
    model's missing heads are initialised here (they are small) and named in ``fresh_heads``."""
    cfg = model_config_from_hf(hf_config, **overrides)
    if not any(k.startswith("bert.") for k in state):  # a bare BertModel / MegatronBertModel
        state = {f"bert.{k}": v for k, v in state.items()}
    bare = not any(k.startswith("cls.") for k in state)
    makers = lazy_hf_to_canonical(state, cfg, lm_head=not bare)
    names: dict[str, torch.Tensor] = {n: torch.empty(0, device="meta") for n in makers}
    fresh = add_fresh_heads(names, cfg)
    makers.update((n, functools.partial(_same, t)) for n, t in names.items() if n not in makers)
    return HFImport(cfg=cfg, makers=makers, add_binary_head="binary_head.weight" in makers, fresh_heads=fresh)


def export_config(cfg: ModelConfig, family: Family, *, special_ids: Mapping[str, int | None],
                  fresh_heads: tuple[str, ...] = ()) -> dict[str, object]:  # fmt: skip
    pad = {"pad_token_id": special_ids["pad_token_id"]} if "pad_token_id" in special_ids else {}
    return {**hf_config_kwargs(cfg), "architectures": [hf_architecture(cfg, bare="lm_head" in fresh_heads)],
            **pad, **family.hf_extra}  # fmt: skip


def export_tensors(full: Mapping[str, torch.Tensor], cfg: ModelConfig, *, fresh_heads: tuple[str, ...] = (),
                   family: Family | None = None, copy: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    return canonical_to_hf(full, cfg, include_tied=False, fresh_heads=fresh_heads, copy=copy)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
