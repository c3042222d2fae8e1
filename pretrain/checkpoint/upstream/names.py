"""Upstream Megatron-LM parameter names and QKV row orders -> our local names and order.

Every era of upstream checkpoints is read through two pure functions:

* :func:`to_local_name` maps one flat key of a model chunk (``model`` / ``model{i}``, flattened
  with :func:`pretrain.checkpoint.legacy.layout.flatten`) to the local parameter name of our
  ``GPTModel`` / ``BertModel`` chunk (layer indices stay local to the chunk). It accepts the
  legacy names (``language_model.encoder``), their older spellings (``transformer`` for
  ``encoder``, ``attention`` for ``self_attention``, top-level ``word_embeddings``), the newer
  ``*_norm`` spellings, and megatron-core names (``decoder.layers.{i}.self_attention.linear_qkv``,
  Transformer-Engine fused ``layer_norm_weight``, ``output_layer``, ...).
* :func:`to_mcore_key` is the way back for ``torch_dist`` output, over the same tables: our
  canonical tensor of a GPT or BERT model -> megatron-core's sharded-state-dict key
  (``decoder.layers.*`` for ``GPTModel``, ``encoder.layers.*`` and the BERT heads for ``BertModel``).
* :func:`qkv_to_canonical` reorders the fused QKV rows of one TP shard from the order of the
  file's ``checkpoint_version`` to ours, ``[heads][3][head_dim]``.
"""

from __future__ import annotations

import re

import torch

from pretrain.checkpoint.upstream.expert_names import SKIPPED as _MOE_SKIPPED
from pretrain.checkpoint.upstream.expert_names import from_mcore_layer, to_mcore_layer
from pretrain.models.kinds import KINDS

LM = "language_model."
ENC = LM + "encoder."

# megatron-core names (applied to the part after ``decoder.layers.{i}.``)
_MCORE_LAYER = [
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "post_attention_layernorm.bias"),
    ("self_attention.linear_qkv.", "self_attention.query_key_value."),
    ("self_attention.linear_proj.", "self_attention.dense."),
    ("pre_mlp_layernorm.", "post_attention_layernorm."),
    ("mlp.linear_fc1.", "mlp.dense_h_to_4h."),
    ("mlp.linear_fc2.", "mlp.dense_4h_to_h."),
]
# megatron-core top-level names <-> ours: (megatron-core prefix, our prefix, kinds written so).
# Reading takes the first row whose megatron-core prefix starts the key; writing
# (:func:`to_mcore_key`) the first row whose our prefix starts the tensor and whose kinds hold the
# model's kind (no kinds: an older spelling, read only).
_MCORE_TOP: list[tuple[str, str, tuple[str, ...]]] = [
    ("embedding.", LM + "embedding.", ("gpt", "bert")),
    ("decoder.final_layernorm.", ENC + "final_layernorm.", ("gpt",)),
    ("decoder.final_norm.", ENC + "final_layernorm.", ()),
    ("encoder.final_layernorm.", ENC + "final_layernorm.", ("bert",)),  # megatron-core BertModel
    ("output_layer.weight", "word_embeddings_for_head.weight", ()),  # tied or not: the reader decides
    ("output_layer.weight", LM + "output_layer.weight", ("gpt", "bert")),  # untied (written only)
    ("output_layer.bias", "lm_head.bias", ("bert",)),  # megatron-core BERT: the MLM output bias
    ("lm_head.layer_norm.", "lm_head.layernorm.", ("bert",)),
    ("lm_head.dense.", "lm_head.dense.", ("bert",)),
    ("binary_head.", "binary_head.", ("bert",)),
    ("pooler.", LM + "pooler.", ("bert",)),
]
# the block holding the layers: megatron-core's GPTModel has a decoder, its BertModel an encoder
MCORE_BLOCK = {k.name: k.mcore_block for k in KINDS.values()}
_MCORE_LAYERS = re.compile(r"^(?:decoder|encoder)\.layers\.(\d+)\.(.*)$")
# legacy spellings
_OLD_TOP = [
    ("transformer.", ENC),  # Megatron v1 GPT-2: no language_model prefix
    ("word_embeddings.", LM + "embedding.word_embeddings."),
    ("position_embeddings.", LM + "embedding.position_embeddings."),
    ("tokentype_embeddings.", LM + "embedding.tokentype_embeddings."),
    (LM + "transformer.", ENC),
]
_NORM = re.compile(r"(^|\.)(input|post_attention|post_mlp|final)_norm\.")
_SKIPPED = ("_extra_state", ".inv_freq", "rotary_pos_emb")


def _replace_prefix(
    name: str, table: list[tuple[str, str]] | list[tuple[str, str, tuple[str, ...]]]
) -> str | None:
    for old, new, *_ in table:
        if name.startswith(old):
            return new + name[len(old) :]
    return None


def _mcore_name(name: str) -> str | None:
    m = _MCORE_LAYERS.match(name)
    if m is not None:
        i, rest = m.groups()
        moe = from_mcore_layer(rest)  # experts and shared experts (pretrain.checkpoint.upstream.expert_names)
        if moe is not None:
            return f"{ENC}layers.{i}.{moe}"
        for old, new in _MCORE_LAYER:
            if rest.startswith(old):
                rest = new + rest[len(old) :]
                break
        return f"{ENC}layers.{i}.{rest}"
    return _replace_prefix(name, _MCORE_TOP)


def to_local_name(key: str) -> str | None:
    """Our local parameter name for upstream flat ``key``; None for entries to skip."""
    if key.endswith(_SKIPPED) or key.endswith(_MOE_SKIPPED) or "._extra_state" in key:
        return None
    # Legacy keys match no megatron-core prefix, so the order of the two tables is free.
    key = _replace_prefix(key, _OLD_TOP) or _mcore_name(key) or key
    if key.startswith(ENC) and ".attention." in key:
        key = key.replace(".attention.", ".self_attention.", 1)
    return _NORM.sub(lambda m: f"{m.group(1)}{m.group(2)}_layernorm.", key)


def is_qkv(local_name: str) -> bool:
    return local_name.endswith(("query_key_value.weight", "query_key_value.bias"))


def _split_shape(version: float, heads: int, head_dim: int) -> tuple[int, int, int]:
    if version < 1.0:
        return (3, heads, head_dim)
    if version < 2.0:
        return (heads, head_dim, 3)
    return (heads, 3, head_dim)


def qkv_to_canonical(shard: torch.Tensor, *, version: float, heads: int, head_dim: int) -> torch.Tensor:
    """One TP shard's fused QKV rows (``heads`` local heads) in ``version`` order -> ``[heads][3][hd]``.

    checkpoint_version 0: ``[3][heads][hd]``; 1.0: ``[heads][hd][3]``; 2.0 and 3.0: ours.
    """
    if version >= 2.0:
        return shard
    rest = shard.shape[1:]
    x = shard.reshape(*_split_shape(version, heads, head_dim), *rest)
    perm = (1, 0, 2) if version < 1.0 else (0, 2, 1)
    x = x.permute(*perm, *range(3, x.dim()))
    return x.reshape(shard.shape).contiguous()


def qkv_from_canonical(shard: torch.Tensor, *, version: float, heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`qkv_to_canonical` (used to write upstream-era fixtures)."""
    if version >= 2.0:
        return shard
    rest = shard.shape[1:]
    x = shard.reshape(heads, 3, head_dim, *rest)
    perm = (1, 0, 2) if version < 1.0 else (0, 2, 1)
    x = x.permute(*perm, *range(3, x.dim()))
    return x.reshape(shard.shape).contiguous()


_LAYER = re.compile(r"^language_model\.encoder\.layers\.(\d+)\.(.*)$")


def to_mcore_key(canonical: str, kind: str = "gpt") -> tuple[str, int | None]:
    """megatron-core ``torch_dist`` key of our canonical tensor of a ``kind`` model, and its layer.

    The inverse of :func:`to_local_name` over the same tables, with the names ``torch_dist``
    files use whatever the spec (the TransformerEngine spelling: norms folded into ``linear_qkv``
    / ``linear_fc1`` as ``layer_norm_weight``/``layer_norm_bias``). Layers become one stacked key
    ``decoder.layers.<rest>`` (GPT) or ``encoder.layers.<rest>`` (BERT) of shape ``[num_layers, ...]``.
    """
    m = _LAYER.match(canonical)
    if m is not None:
        layer, rest = int(m.group(1)), m.group(2)
        block = MCORE_BLOCK[kind] + ".layers."
        shared = to_mcore_layer(rest) if rest.startswith("mlp.shared_experts.") else None
        if shared is not None:
            return block + shared, layer
        for mcore, ours in _MCORE_LAYER:  # exact TE names come first in the table
            if rest == ours or (ours.endswith(".") and rest.startswith(ours)):
                return block + mcore + rest[len(ours) :], layer
        return block + rest, layer
    for mcore, ours, kinds in _MCORE_TOP:
        if kind in kinds and canonical.startswith(ours):
            return mcore + canonical[len(ours) :], None
    raise ValueError(f"no megatron-core name for tensor {canonical!r}")


def to_mcore_state_name(local: str, kind: str = "gpt") -> str:
    """megatron-core's flat ``state_dict`` name (local spec) of one of our chunk's local names.

    The same tables as :func:`to_mcore_key`, but per layer (``decoder.layers.N.``, N local to
    the chunk) and with the local spec's own norm modules (``input_layernorm``,
    ``pre_mlp_layernorm``) rather than the TransformerEngine fold ``torch_dist`` uses; the last
    stage's copy of tied embeddings is megatron-core's ``output_layer.weight``."""
    m = _LAYER.match(local)
    if m is not None:
        layer, rest = m.groups()
        moe = to_mcore_layer(rest)  # SequentialMLP experts (local index), shared experts
        for mcore, ours in _MCORE_LAYER if moe is None else ():
            if ours.endswith(".") and rest.startswith(ours):  # module renames, not the TE folds
                rest = mcore + rest[len(ours) :]
                break
        rest = moe or rest
        return f"{MCORE_BLOCK[kind]}.layers.{layer}.{rest}"
    if local.startswith("word_embeddings_for_head."):
        return "output_layer." + local[len("word_embeddings_for_head.") :]
    for mcore, ours, kinds in _MCORE_TOP:
        if kind in kinds and local.startswith(ours):
            return mcore + local[len(ours) :]
    raise ValueError(f"no megatron-core name for tensor {local!r}")
