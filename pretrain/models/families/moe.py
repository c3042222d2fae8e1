"""Canonical mixture-of-experts decoders <-> Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

The attention, norms, embeddings and RoPE are the Llama family's (the config keys of the ``llama``
option group, :func:`pretrain.models.families.llama.config_from_hf`); each family's MoE keys are its
own option group layered over it (``pretrain/model_options.py``). What is not one key to one field:

* routing: ``norm_topk_prob=True`` (renormalised top-k; Mixtral always) is Megatron's default,
  ``False`` is ``--moe-router-pre-softmax`` (``tests/test_moe_layer.py`` checks both against
  megatron-core's router);
* which layers are MoE: Qwen's ``decoder_sparse_step`` and ``mlp_only_layers`` <-> a
  ``moe_layer_freq`` pattern (export writes step 1 and the dense layers as ``mlp_only_layers``).

Tensors: :mod:`pretrain.models.families.moe_names`. Import reads the per-expert layout or
transformers 5's fused one and refuses, before any tensor is converted, a missing or extra
tensor, a wrong shape, a fused expert tensor whose orientation its shape cannot tell
(transformers #47031), an expert count that disagrees with ``config.json`` and an all-zero
router. Export writes the per-expert layout, as ``save_pretrained`` does.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping

import torch

from pretrain.config import ModelConfig
from pretrain.model_option_hf import config_kwargs_from_hf, hf_kwargs, hf_unsupported
from pretrain.models.families import llama
from pretrain.models.families.converter import HFConfig, HFImport, RowPartsMaker, makers_from_row_parts
from pretrain.models.families.moe_names import FUSED_GATE_UP, Piece, pieces
from pretrain.models.families.registry import Family, export_family
from pretrain.models.moe.router import check_router_weight
from pretrain.utils.errors import UserError

ARCHITECTURES = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE", "olmoe": "OLMoE"}
_QWEN = ("qwen2_moe", "qwen3_moe")


def _groups(family: str) -> tuple[str, str]:
    return ("llama", family)


# --- config ---------------------------------------------------------------------------------------


def _layer_pattern(hf_config: HFConfig, layers: int) -> int | tuple[int, ...]:
    """Qwen's MoE layers (``(i + 1) % decoder_sparse_step == 0`` and not in ``mlp_only_layers``)
    as ``moe_layer_freq``: 1 when every layer is MoE, else the 0/1 pattern."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
    return 1 if all(pattern) else pattern


def _check_moe_hf_config(hf_config: HFConfig, family: str) -> None:
    name = f"Hugging Face {ARCHITECTURES[family]} config"
    clip = getattr(hf_config, "clip_qkv", None)
    if family == "olmoe" and clip is not None:
        raise UserError(f"{name}: clip_qkv={clip} (clamped q/k/v) is not supported")
    if int(getattr(hf_config, "num_experts", 0) or 0) <= 0:
        raise UserError(f"{name}: num_experts must be positive (a model without experts is a dense family)")


def config_from_hf(hf_config: HFConfig, family: Family, **overrides: object) -> ModelConfig:
    """Our :class:`ModelConfig` from ``family``'s HF config (``overrides`` win)."""
    fam = family.model_type
    _check_moe_hf_config(hf_config, fam)
    kw: dict[str, object] = config_kwargs_from_hf(hf_config, _groups(fam))
    # llama's intermediate_size column: the dense width (Mixtral and OLMoE: the expert width too)
    kw["ffn_hidden_size"] = int(getattr(hf_config, "intermediate_size"))  # noqa: B009
    if fam != "mixtral":
        kw["moe_router_pre_softmax"] = not bool(getattr(hf_config, "norm_topk_prob", False))
    if fam in _QWEN:
        kw["moe_layer_freq"] = _layer_pattern(hf_config, int(getattr(hf_config, "num_hidden_layers")))  # noqa: B009
    if fam == "qwen2_moe":
        kw["moe_shared_expert_gate"] = True
    kw.update(overrides)
    return llama.config_from_hf(hf_config, family, **kw)


def unsupported(cfg: ModelConfig, family: str) -> list[str]:
    """The options of ``cfg`` that ``family``'s architecture cannot express (table, then conditions)."""
    arch = ARCHITECTURES[family]
    out = hf_unsupported(cfg, _groups(family), arch)
    out += llama.conditions(cfg)
    if cfg.num_experts is None:
        out.append(f"num_experts=None ({arch} has mixture-of-experts MLPs)")
        return out
    if family in ("mixtral", "olmoe") and not all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        out.append(f"moe_layer_freq={cfg.moe_layer_freq} ({arch} has experts in every layer)")
    if family in ("qwen2_moe", "olmoe") and cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        out.append(f"kv_channels={cfg.kv_channels} ({arch} has head_dim = hidden_size / heads)")
    return out


def _check(cfg: ModelConfig, family: str) -> None:
    problems = unsupported(cfg, family)
    if problems:
        raise UserError(f"to-hf: {ARCHITECTURES[family]} cannot express " + "; ".join(problems))


def check_exportable(cfg: ModelConfig, *, family: Family | None = None) -> None:
    _check(cfg, (family or family_of(cfg)).model_type)


def export_config(cfg: ModelConfig, family: Family, *, special_ids: Mapping[str, int | None],
                  fresh_heads: tuple[str, ...] = ()) -> dict[str, object]:  # fmt: skip
    fam = family.model_type
    _check(cfg, fam)
    kw: dict[str, object] = {
        **llama.export_config(cfg, family, special_ids=special_ids),
        **hf_kwargs(cfg, _groups(fam)),  # the family's MoE keys (pretrain.model_options)
    }
    if fam in ("mixtral", "olmoe"):
        kw["intermediate_size"] = cfg.moe_ffn_size
    else:
        kw["intermediate_size"] = cfg.ffn_size
        kw["moe_intermediate_size"] = cfg.moe_ffn_size
        kw["decoder_sparse_step"] = 1
        kw["mlp_only_layers"] = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    if fam != "mixtral":
        kw["norm_topk_prob"] = not cfg.moe_router_pre_softmax
    if fam in ("qwen2_moe", "olmoe"):
        kw.pop("head_dim")  # these configs have none (hidden_size / heads)
    elif fam == "mixtral" and cfg.kv_channels is None:
        kw["head_dim"] = None  # as MixtralConfig writes it: hidden_size / heads
    if fam == "qwen2_moe":
        kw["use_sliding_window"] = False
    return kw


# --- tensors --------------------------------------------------------------------------------------


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")


def _fused_layers(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> frozenset[int]:
    return frozenset(i for i in range(cfg.num_layers) if f"model.layers.{i}.{FUSED_GATE_UP}" in state)


def _check_expert_count(given: set[str], cfg: ModelConfig) -> None:
    experts = int(cfg.num_experts or 0)
    for name in sorted(given):
        m = _EXPERT.match(name)
        if m and int(m.group(2)) >= experts:
            raise UserError(
                f"Hugging Face model: {name} is expert {m.group(2)} but config.json has num_experts={experts} "
                "(expert count of the config and the tensors disagree)"
            )


def _check_names(state: Mapping[str, torch.Tensor], cfg: ModelConfig, plan: list[Piece]) -> None:
    expected = {h for p in plan for h in p.hf}
    given = {k for k in state if not k.endswith("rotary_emb.inv_freq")}
    if not cfg.untie_embeddings_and_output_weights and "lm_head.weight" in given:
        if not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
            raise UserError("Hugging Face model: tie_word_embeddings is set but lm_head.weight differs")
        given.discard("lm_head.weight")
    _check_expert_count(given - expected, cfg)
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing:
        raise UserError(f"Hugging Face model: missing tensor {missing[0]}" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))  # fmt: skip
    if unexpected:
        raise UserError(f"Hugging Face model: unexpected tensor {unexpected[0]}" + (
            f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))  # fmt: skip


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...], what: str, make: str) -> None:
    if got == want:
        if make.startswith("fused") and want[1] == want[2]:  # transformers #47031
            raise UserError(
                f"Hugging Face model: {name} {list(want)} is square per expert, so its orientation is "
                f"ambiguous (a transposed {what} has the same shape); save it with the per-expert layout"
            )
        return
    if make.startswith("fused") and len(got) == 3 and got[0] != want[0]:
        raise UserError(
            f"Hugging Face model: {name} holds {got[0]} experts but config.json has num_experts={want[0]}"
        )
    flipped = len(got) >= 2 and got[:-2] + (got[-1], got[-2]) == want
    raise UserError(
        f"Hugging Face model: {name} has shape {list(got)}, expected {list(want)} {what}"
        + (" (transposed)" if flipped else "")
    )


def lazy_hf_to_canonical(hf: Mapping[str, torch.Tensor], cfg: ModelConfig, family: str) -> dict[str, Callable[[], torch.Tensor]]:  # fmt: skip
    """A ``*ForCausalLM`` state dict (either expert layout, per layer) -> each canonical tensor's
    maker; names, shapes, expert counts and routers are checked now (see the module docstring)."""
    plan = pieces(cfg, family, fused_layers=_fused_layers(hf, cfg))
    _check_names(hf, cfg, plan)
    for p in plan:
        for name, want, what in zip(p.hf, p.shapes, p.what, strict=True):
            _check_shape(name, tuple(hf[name].shape), want, what, p.make)
        if p.ours.endswith("mlp.router.weight"):
            check_router_weight(f"Hugging Face model: {p.hf[0]}", hf[p.hf[0]])
    return makers_from_row_parts(hf_row_parts(hf, cfg, family))


def hf_row_parts(hf: Mapping[str, torch.Tensor], cfg: ModelConfig, family: str) -> dict[str, RowPartsMaker]:
    """Each canonical tensor as the row blocks of the HF tensors that :func:`lazy_hf_to_canonical`'s
    maker joins, as views (:class:`~pretrain.models.families.converter.HFImport`; checked there)."""
    plan = pieces(cfg, family, fused_layers=_fused_layers(hf, cfg))
    return {p.ours: functools.partial(_rows, p, *(hf[h] for h in p.hf), cfg=cfg) for p in plan}


def _rows(p: Piece, *ts: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    if p.make == "qkv":
        return llama.qkv_rows(*ts, groups=cfg.query_groups, head_dim=cfg.head_dim)
    if p.make == "cat":
        return ts
    if p.make.startswith("fused"):
        return (ts[0][p.expert],)
    return (ts[0],)


def canonical_to_hf(full: Mapping[str, torch.Tensor], cfg: ModelConfig, family: str, *,
                    copy: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    """Canonical full tensors -> the per-expert state dict ``save_pretrained`` writes. ``full`` may
    hold ``meta`` tensors (the streamed writer's other layers): they map to ``meta`` tensors.
    ``copy=False``: outputs may share memory with ``full``."""
    out: dict[str, torch.Tensor] = {}
    for p in pieces(cfg, family):
        if p.ours not in full:
            raise UserError(f"checkpoint -> Hugging Face: missing tensor {p.ours}")
        t = full[p.ours].detach()
        if p.ours.endswith("mlp.router.weight"):
            check_router_weight(f"checkpoint -> Hugging Face: {p.ours}", t)
        if p.make == "qkv":
            parts: tuple[torch.Tensor, ...] = llama.split_qkv(
                t, groups=cfg.query_groups, head_dim=cfg.head_dim
            )
        elif p.make == "cat":
            parts = tuple(t.chunk(2))
        else:
            parts = (t,)
        for name, piece in zip(p.hf, parts, strict=True):
            out[name] = piece.contiguous().clone() if copy else piece.contiguous()
    return out


# --- the converter interface (pretrain.models.families.converter) ---------------------------------


def import_hf(
    state: Mapping[str, torch.Tensor], hf_config: HFConfig, family: Family, **overrides: object
) -> HFImport:
    cfg = config_from_hf(hf_config, family, **overrides)
    makers = lazy_hf_to_canonical(state, cfg, family.model_type)  # (checks names, shapes, routers first)
    return HFImport(cfg=cfg, makers=makers, row_parts=hf_row_parts(state, cfg, family.model_type))


def export_tensors(full: Mapping[str, torch.Tensor], cfg: ModelConfig, *, fresh_heads: tuple[str, ...] = (),
                   family: Family | None = None, copy: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    fam = family or family_of(cfg)
    _check(cfg, fam.model_type)
    return canonical_to_hf(full, cfg, fam.model_type, copy=copy)


def family_of(cfg: ModelConfig) -> Family:
    """The MoE family of ``cfg`` when the caller names none (the registry's choice)."""
    fam = export_family(dataclasses.asdict(cfg), "gpt")
    if fam.model_type not in ARCHITECTURES:
        raise UserError(f"to-hf: no mixture-of-experts family holds this model ({fam.model_type} is dense)")
    return fam
