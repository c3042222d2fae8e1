"""The tensor tables of the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): which
Hugging Face tensors make each canonical one, in both Hugging Face layouts.

* Per expert (published checkpoints, and what ``save_pretrained`` of transformers 5 writes):
  Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2`` and ``block_sparse_moe.gate``; the others
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` and ``mlp.gate``; Qwen2-MoE's
  ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``.
* Fused (transformers 5's in-memory modules, read only): ``mlp.experts.gate_up_proj [E, 2I, H]``
  (rows ``[gate; up]`` per expert) and ``mlp.experts.down_proj [E, H, I]``; the router is
  ``mlp.gate.weight`` for every family.

A :class:`Piece` is one canonical tensor and how it is made; :func:`pieces` lists a model's.
Pure names and shapes (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pretrain.config import ModelConfig
from pretrain.model_option_hf import absent_modules

LM = "language_model."
Make = Literal["copy", "cat", "qkv", "fused_gate_up", "fused_down"]


@dataclass(frozen=True, kw_only=True)
class ExpertNames:
    """A family's per-expert names under ``model.layers.{i}.``: the block (its router is
    ``{block}.gate``) and the gate / up / down projections of ``{block}.experts.{e}.``."""

    block: str
    gate: str
    up: str
    down: str

    def router(self) -> str:
        return f"{self.block}.gate.weight"


MIXTRAL = ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")
QWEN = ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
EXPERT_NAMES = {"mixtral": MIXTRAL, "qwen2_moe": QWEN, "qwen3_moe": QWEN, "olmoe": QWEN}
FUSED_GATE_UP, FUSED_DOWN, FUSED_ROUTER = (
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
    "mlp.gate.weight",
)


@dataclass(frozen=True, kw_only=True)
class Piece:
    """Canonical tensor ``ours`` made from Hugging Face tensors ``hf`` by ``make``: ``copy`` (one
    tensor), ``cat`` (rows of ``[gate; up]``), ``qkv`` (q, k, v into our group order), or expert
    ``expert`` of a fused ``[E, ...]`` tensor. ``shapes``: each HF tensor's expected shape, and
    ``what`` the names of its dimensions (for messages)."""

    ours: str
    hf: tuple[str, ...]
    make: Make
    shapes: tuple[tuple[int, ...], ...]
    what: tuple[str, ...]
    expert: int = -1


def _attention(cfg: ModelConfig, i: int) -> list[Piece]:
    ours, hf = f"{LM}encoder.layers.{i}.", f"model.layers.{i}."
    h, d, nq, g = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.query_groups
    out = [
        Piece(ours=ours + "input_layernorm.weight", hf=(hf + "input_layernorm.weight",), make="copy",
              shapes=((h,),), what=("[hidden]",)),
        Piece(ours=ours + "post_attention_layernorm.weight", hf=(hf + "post_attention_layernorm.weight",),
              make="copy", shapes=((h,),), what=("[hidden]",)),
        Piece(ours=ours + "self_attention.dense.weight", hf=(hf + "self_attn.o_proj.weight",), make="copy",
              shapes=((h, nq * d),), what=("[hidden, heads x head_dim]",)),
    ]  # fmt: skip
    kinds = ("weight", "bias") if cfg.qkv_bias else ("weight",)
    for kind in kinds:
        rest: tuple[int, ...] = (h,) if kind == "weight" else ()
        out.append(Piece(
            ours=f"{ours}self_attention.query_key_value.{kind}",
            hf=tuple(f"{hf}self_attn.{p}_proj.{kind}" for p in "qkv"), make="qkv",
            shapes=((nq * d, *rest), (g * d, *rest), (g * d, *rest)), what=("[q heads x head_dim, ...]",) * 3,
        ))  # fmt: skip
    # per-head or full-width QK-norm: the option table says which modules a config lacks
    norms = [("q_layernorm", "q_norm", d), ("k_layernorm", "k_norm", d),
             ("q_full_layernorm", "q_norm", nq * d), ("k_full_layernorm", "k_norm", g * d)]  # fmt: skip
    absent = absent_modules(cfg)
    for a, b, n in (norm for norm in norms if norm[0] not in absent):
        out.append(Piece(ours=f"{ours}self_attention.{a}.weight", hf=(f"{hf}self_attn.{b}.weight",), make="copy",
                         shapes=((n,),), what=("[norm width]",)))  # fmt: skip
    return out


def _swiglu(ours: str, hf: str, names: tuple[str, str, str], h: int, width: int) -> list[Piece]:
    """A gated MLP ``ours.dense_h_to_4h / dense_4h_to_h`` from ``hf.{gate, up, down}.weight``."""
    gate, up, down = (f"{hf}{n}.weight" for n in names)
    return [
        Piece(ours=f"{ours}dense_h_to_4h.weight", hf=(gate, up), make="cat", shapes=((width, h), (width, h)),
              what=("[width, hidden]", "[width, hidden]")),
        Piece(ours=f"{ours}dense_4h_to_h.weight", hf=(down,), make="copy", shapes=((h, width),),
              what=("[hidden, width]",)),
    ]  # fmt: skip


def _moe(cfg: ModelConfig, i: int, family: str, *, fused: bool) -> list[Piece]:
    ours, hf = f"{LM}encoder.layers.{i}.mlp.", f"model.layers.{i}."
    h, width, experts = cfg.hidden_size, cfg.moe_ffn_size, int(cfg.num_experts or 0)
    names = EXPERT_NAMES[family]
    router = hf + (FUSED_ROUTER if fused else names.router())
    out = [Piece(ours=ours + "router.weight", hf=(router,), make="copy", shapes=((experts, h),),
                 what=("[experts, hidden]",))]  # fmt: skip
    for e in range(experts):
        expert = f"{ours}experts.{e}."
        if fused:
            out += [
                Piece(ours=expert + "dense_h_to_4h.weight", hf=(hf + FUSED_GATE_UP,), make="fused_gate_up",
                      shapes=((experts, 2 * width, h),), what=("[experts, 2 x expert width, hidden]",), expert=e),
                Piece(ours=expert + "dense_4h_to_h.weight", hf=(hf + FUSED_DOWN,), make="fused_down",
                      shapes=((experts, h, width),), what=("[experts, hidden, expert width]",), expert=e),
            ]  # fmt: skip
        else:
            out += _swiglu(
                expert, f"{hf}{names.block}.experts.{e}.", (names.gate, names.up, names.down), h, width
            )
    shared = cfg.moe_shared_expert_intermediate_size
    if shared is not None:
        out += _swiglu(ours + "shared_experts.", hf + "mlp.shared_expert.", ("gate_proj", "up_proj", "down_proj"),
                       h, shared)  # fmt: skip
        if cfg.moe_shared_expert_gate:
            out.append(Piece(ours=ours + "shared_experts.gate_weight", hf=(hf + "mlp.shared_expert_gate.weight",),
                             make="copy", shapes=((1, h),), what=("[1, hidden]",)))  # fmt: skip
    return out


def layer_pieces(cfg: ModelConfig, i: int, family: str, *, fused: bool = False) -> list[Piece]:
    """Layer ``i``'s pieces: attention, then a dense gated MLP or the MoE block (``fused``: the
    experts as transformers 5's fused tensors)."""
    out = _attention(cfg, i)
    if cfg.is_moe_layer(i):
        return out + _moe(cfg, i, family, fused=fused)
    names = ("gate_proj", "up_proj", "down_proj")
    return out + _swiglu(f"{LM}encoder.layers.{i}.mlp.", f"model.layers.{i}.mlp.", names, cfg.hidden_size,
                         cfg.ffn_size)  # fmt: skip


def global_pieces(cfg: ModelConfig) -> list[Piece]:
    """Embeddings, final norm and (untied) head; the vocabulary rows are the true vocabulary."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out = [
        Piece(ours=f"{LM}embedding.word_embeddings.weight", hf=("model.embed_tokens.weight",), make="copy",
              shapes=((v, h),), what=("[vocab, hidden]",)),
        Piece(ours=f"{LM}encoder.final_layernorm.weight", hf=("model.norm.weight",), make="copy", shapes=((h,),),
              what=("[hidden]",)),
    ]  # fmt: skip
    if cfg.untie_embeddings_and_output_weights:
        out.append(Piece(ours=f"{LM}output_layer.weight", hf=("lm_head.weight",), make="copy", shapes=((v, h),),
                         what=("[vocab, hidden]",)))  # fmt: skip
    return out


def pieces(cfg: ModelConfig, family: str, *, fused_layers: frozenset[int] = frozenset()) -> list[Piece]:
    """Every canonical tensor of ``cfg`` as Hugging Face ``family`` names it (``fused_layers``:
    the layers whose experts are stored fused)."""
    out = global_pieces(cfg)
    for i in range(cfg.num_layers):
        out += layer_pieces(cfg, i, family, fused=i in fused_layers)
    return out
