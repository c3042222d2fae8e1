"""Codecs of the model option table (:mod:`pretrain.model_options`): Megatron ``args`` meanings
that are not one field to one field -- GQA's two fields, the GeLU flavour (see :func:`gelu_kind`),
QKV bias, RoPE's older spelling, kv_channels' default, both norm-epsilon spellings.

Megatron's GeLU differs between its two model families: legacy models run tanh GeLU for
``openai_gelu`` and for the fused bias-GeLU kernel; megatron-core ignores ``openai_gelu`` and runs
exact ``F.gelu`` unless the fused bias-GeLU kernel (tanh) is on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pretrain.config import ModelConfig
from pretrain.utils.errors import UserError

Args = Mapping[str, object]
ArgsReader = Callable[[Args, str], object]  # (args, source) -> our field's value
ArgsWriter = Callable[[ModelConfig, bool], dict[str, object]]  # (cfg, mcore) -> Megatron fields


def is_mcore(args: Args) -> bool:
    """Whether ``args`` describe a megatron-core model (``use_legacy_models`` false).

    megatron-core 0.18 removed the legacy models and ``use_legacy_models`` with them; its args keep
    ``deprecated_use_mcore_models`` (the dead ``--use-mcore-models`` flag), so they are megatron-core.
    """
    if "use_legacy_models" in args:
        return not args["use_legacy_models"]
    if "use_mcore_models" in args:
        return bool(args["use_mcore_models"])
    return "deprecated_use_mcore_models" in args


def gelu_kind(args: Args, *, mcore: bool) -> str:
    """``tanh`` or ``erf``: what GeLU the model ran (see the module docstring)."""
    fused = bool(args.get("bias_gelu_fusion")) and bool(args.get("add_bias_linear", True))
    if mcore:
        return "tanh" if fused else "erf"
    if args.get("openai_gelu"):
        return "tanh"
    if args.get("onnx_safe"):
        return "erf"
    return "tanh" if fused else "erf"


def read_gelu(args: Args, source: str) -> object:
    return gelu_kind(args, mcore=is_mcore(args))


def write_gelu(cfg: ModelConfig, mcore: bool) -> dict[str, object]:
    # megatron-core runs exact GeLU unless the fused bias-GeLU kernel (tanh) is on; legacy takes openai_gelu.
    tanh = cfg.gelu == "tanh"
    return {"openai_gelu": tanh, "bias_gelu_fusion": mcore and tanh and cfg.add_bias_linear}


def need_int(args: Args, key: str, source: str) -> int:
    """``int(args[key])``, or one line naming the field and the Megatron-LM flag that sets it."""
    value = args.get(key)
    if not isinstance(value, int | float | str) or isinstance(value, bool):
        raise UserError(
            f"{source}: args lack {key} (Megatron-LM's --{key.replace('_', '-')}), needed to read this checkpoint"
        )
    return int(value)


def read_groups(args: Args, source: str) -> object:
    if not args.get("group_query_attention"):
        return None
    return need_int(args, "num_query_groups", source)


def write_groups(cfg: ModelConfig, mcore: bool) -> dict[str, object]:
    gqa = cfg.num_query_groups
    return {"group_query_attention": bool(gqa) and gqa != cfg.num_attention_heads,
            "num_query_groups": gqa or cfg.num_attention_heads}  # fmt: skip


def read_position(args: Args, source: str) -> object:
    pos = str(args.get("position_embedding_type") or "learned_absolute")
    if args.get("use_rotary_position_embeddings"):
        pos = "rope"
    if pos not in ("learned_absolute", "rope"):
        raise UserError(
            f"{source}: args.position_embedding_type={pos}: only learned_absolute and rope are supported"
        )
    if pos == "learned_absolute" and args.get("add_position_embedding") is False:
        raise UserError(f"{source}: args.add_position_embedding=False without rope: no position information")
    return pos


def write_position(cfg: ModelConfig, mcore: bool) -> dict[str, object]:
    rope = cfg.position_embedding_type == "rope"
    return {"position_embedding_type": cfg.position_embedding_type, "add_position_embedding": not rope,
            "use_rotary_position_embeddings": False}  # fmt: skip


def read_qkv_bias(args: Args, source: str) -> object:
    # Megatron adds a QKV bias for add_bias_linear or add_qkv_bias; ours is the QKV-only extra.
    return bool(args.get("add_qkv_bias")) and args.get("add_bias_linear", True) is False


def write_qkv_bias(cfg: ModelConfig, mcore: bool) -> dict[str, object]:
    return {"add_qkv_bias": cfg.qkv_bias}


def read_bias(args: Args, source: str) -> object:
    return args.get("add_bias_linear", True) is not False


def read_kv_channels(args: Args, source: str) -> object:
    kv = args.get("kv_channels")
    hidden, heads = args.get("hidden_size"), args.get("num_attention_heads")
    if not kv or (isinstance(hidden, int) and isinstance(heads, int) and heads and kv == hidden // heads):
        return None
    return int(kv)  # type: ignore[call-overload]


def write_kv_channels(cfg: ModelConfig, mcore: bool) -> dict[str, object]:
    return {"kv_channels": cfg.head_dim}


def read_normalization(args: Args, source: str) -> object:
    norm = str(args.get("normalization") or "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        raise UserError(f"{source}: args.normalization={norm}: only LayerNorm and RMSNorm are supported")
    return norm


def read_epsilon(args: Args, source: str) -> object:
    return float(args.get("layernorm_epsilon", args.get("norm_epsilon", 1e-5)) or 1e-5)  # type: ignore[arg-type]


def write_epsilon(cfg: ModelConfig, mcore: bool) -> dict[str, object]:
    return {"layernorm_epsilon": cfg.layernorm_epsilon, "norm_epsilon": cfg.layernorm_epsilon}


def read_interpolation(args: Args, source: str) -> object:
    factor = args.get("rotary_seq_len_interpolation_factor")
    return None if factor in (None, 1, 1.0) else float(factor)  # type: ignore[arg-type]


def parse_layer_freq(text: str) -> int | tuple[int, ...]:
    """``--moe-layer-freq``: an integer N (every N-th layer is MoE) or a 0/1 list per layer, written
    as a list (``[1,0,1,1]``) or Megatron's expression form (``([1]*3+[0]*1)``)."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    import re

    body = text.strip("()").replace(" ", "")
    out: list[int] = []
    for part in body.split("+"):
        m = re.fullmatch(r"\[([01](?:,[01])*)\](?:\*(\d+))?", part)
        if m is None:
            raise UserError(f"--moe-layer-freq: {text!r} is neither an integer nor a 0/1 list like [1,0,1,1]")
        out += [int(v) for v in m.group(1).split(",")] * int(m.group(2) or 1)
    return tuple(out)


def read_layer_freq(args: Args, source: str) -> object:
    value = args.get("moe_layer_freq", 1)
    if isinstance(value, str):
        return parse_layer_freq(value)
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return int(value) if value else 1  # type: ignore[call-overload]


def write_layer_freq(cfg: ModelConfig, mcore: bool) -> dict[str, object]:
    freq = cfg.moe_layer_freq
    return {"moe_layer_freq": freq if isinstance(freq, int) else list(freq)}


def read_load_balancing(args: Args, source: str) -> object:
    """``aux_loss`` or ``none``; Megatron's other balancing types (a list of several, ``seq_aux_loss``,
    ``global_aux_loss``, ``sinkhorn``) are refused with one line."""
    value = args.get("moe_router_load_balancing_type") or "aux_loss"
    if value not in ("aux_loss", "none"):
        raise UserError(
            f"{source}: args.moe_router_load_balancing_type={value!r} is not supported (aux_loss or none)"
        )
    return value


def read_aux_coeff(args: Args, source: str) -> object:
    """``moe_aux_loss_coeff`` (a per-type list in newer Megatron: one value only)."""
    value = args.get("moe_aux_loss_coeff") or 0.0
    if isinstance(value, list | tuple):
        if len(value) != 1:
            raise UserError(f"{source}: args.moe_aux_loss_coeff={value!r}: one coefficient only")
        value = value[0]
    return float(value)  # type: ignore[arg-type]
