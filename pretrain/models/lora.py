"""LoRA adapters on the tensor-parallel linears of a GPT/BERT stage (PEFT's LoRA, sharded).

For a target linear ``y = W x (+ b)`` the adapted output is ``y + (alpha / r) B A drop(x)``, with
``A [n r, in]`` and ``B [out, r]`` in float32 (PEFT's ``autocast_adapter_dtype``), ``A`` drawn
like PEFT's (``kaiming_uniform(a=sqrt(5))``: uniform in ``+-1/sqrt(in)``) and ``B`` zero.

**Fused targets hold one A per slice.** ``query_key_value`` fuses q, k and v, and the SwiGLU
``dense_h_to_4h`` fuses gate and up. Their ``A`` is the block form ``[A_q; A_k; A_v]`` ``[3r, in]``
(``[A_gate; A_up]`` ``[2r, in]``), and each row of ``B`` uses the block of its slice: the q rows
of ``B`` (in Megatron's grouped order ``[groups][q heads, k, v][d]``) multiply ``A_q``, and so on.
That is exactly PEFT's LoRA on ``q_proj``/``k_proj``/``v_proj`` (``gate_proj``/``up_proj``), so
a PEFT adapter trained elsewhere (different A per module) round-trips both ways bit for bit, and
our adapters export to per-module PEFT tensors without any approximation. Dropout is drawn per
slice, as PEFT draws it per module.

Sharding follows the base layer (``tp_partition_dim``):

* column-parallel (QKV, fc1): ``A`` replicated, ``B`` split by rows exactly as the base rows
  (the QKV group layout with GQA, SwiGLU ``[gate slice; up slice]``; :mod:`sharding`). The
  low-rank activation ``A x`` enters the TP region through f (backward all-reduce), so the
  gradient of the replicated ``A`` is complete on every rank.
* row-parallel (proj, fc2): ``A`` split along its input (dim 1), ``B`` replicated; ``A x`` is
  reduced over the TP group (g) before ``B``. Dropout of the split input runs under the TP-region
  generator, the replicated input's under the default one (as for the base layer's dropouts).

Canonical names: the base weight's name with ``.weight`` replaced by ``.lora_A.weight`` /
``.lora_B.weight`` (full, unsharded), e.g.
``language_model.encoder.layers.0.self_attention.query_key_value.lora_B.weight``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from pretrain.config import ModelConfig
from pretrain.models.base import ShardedModule
from pretrain.models.cpu_gemm import resolve as resolve_cpu_gemm
from pretrain.models.lora_experts import attach_expert_adapters
from pretrain.models.lora_linear import LoraColumnParallelLinear, LoraRowParallelLinear, slice_ranges
from pretrain.models.lora_ops import LORA_A, LORA_B, LoraWeight, adapter_names, init_adapter_a, slice_mask
from pretrain.models.sharding import shard_tensor
from pretrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from pretrain.utils.errors import UserError
from pretrain.utils.flag_groups import flag_meta

# target -> the module name (suffix) of the linear it adapts
TARGET_MODULES: dict[str, str] = {
    "qkv": "self_attention.query_key_value",
    "proj": "self_attention.dense",
    "fc1": "mlp.dense_h_to_4h",
    "fc2": "mlp.dense_4h_to_h",
}
ALL_TARGETS = tuple(TARGET_MODULES)
# a mixture-of-experts layer's expert linears: routed (global index) or shared
_EXPERT_LINEAR = re.compile(r"mlp\.(experts\.\d+|shared_experts)\.(dense_h_to_4h|dense_4h_to_h)$")


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA settings: ``rank`` r, ``alpha`` (scaling alpha / r, as PEFT without rsLoRA),
    ``dropout`` on the adapter input, and the ``targets`` among :data:`ALL_TARGETS`."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ALL_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise UserError(f"--lora-rank: must be a positive integer, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"--lora-dropout: must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.targets if t not in TARGET_MODULES]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise UserError(
                f"--lora-targets: {','.join(self.targets)!r} is not a non-empty list of distinct "
                f"targets among {','.join(ALL_TARGETS)}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "targets": list(self.targets),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> LoraConfig:
        targets = d.get("targets", ALL_TARGETS)
        return cls(
            rank=int(d["rank"]),  # type: ignore[call-overload]
            alpha=float(d["alpha"]),  # type: ignore[arg-type]
            dropout=float(d.get("dropout", 0.0)),  # type: ignore[arg-type]
            targets=tuple(str(t) for t in targets),  # type: ignore[attr-defined]
        )


@dataclass(frozen=True, kw_only=True)
class LoraFlags:
    """The ``--lora-*`` flags (``mlm-finetune sft``, through :func:`~pretrain.utils.flag_groups.add_flag_group`):
    LoRA is on only with a rank; :meth:`config` is the :class:`LoraConfig` they ask for."""

    lora_rank: int | None = field(
        default=None, metadata=flag_meta("adapter rank r (turns LoRA on)", metavar="R")
    )
    lora_alpha: float | None = field(
        default=None, metadata=flag_meta("scaling alpha / r (default: r)", metavar="ALPHA")
    )
    lora_dropout: float | None = field(
        default=None, metadata=flag_meta("dropout on the adapter input (default: 0)", metavar="P")
    )
    lora_targets: str | None = field(
        default=None,
        metadata=flag_meta(f"comma-separated among {','.join(ALL_TARGETS)} (default: all)", metavar="LIST"),
    )

    def config(self) -> LoraConfig | None:
        """None without ``--lora-rank`` (refused when another ``--lora-*`` flag is given alone)."""
        given = [f"--{f.replace('_', '-')}" for f in ("lora_alpha", "lora_dropout", "lora_targets")
                 if getattr(self, f) is not None]  # fmt: skip
        if self.lora_rank is None:
            if given:
                raise UserError(f"{given[0]} needs --lora-rank R (LoRA is on only with a rank)")
            return None
        targets = (
            ALL_TARGETS
            if self.lora_targets is None
            else tuple(t.strip() for t in self.lora_targets.split(","))
        )
        alpha = float(self.lora_rank if self.lora_alpha is None else self.lora_alpha)
        return LoraConfig(rank=self.lora_rank, alpha=alpha, dropout=self.lora_dropout or 0.0, targets=targets)


def is_lora_name(name: str) -> bool:
    return f".{LORA_A}." in name or f".{LORA_B}." in name


def base_name(adapter: str) -> str:
    """``X.lora_A.weight`` / ``X.lora_B.weight`` -> ``X.weight``."""
    for part in (LORA_A, LORA_B):
        if adapter.endswith(f".{part}.weight"):
            return adapter.removesuffix(f".{part}.weight") + ".weight"
    raise ValueError(f"{adapter!r} is not a LoRA tensor name")


def _stem(name: str) -> str:
    """The module name of a base or adapter tensor name."""
    return base_name(name).removesuffix(".weight") if is_lora_name(name) else name.rsplit(".", 1)[0]


def expert_kind(name: str) -> str | None:
    """``routed`` for a routed expert's fc1/fc2 tensor (base or adapter), ``shared`` for the
    shared expert's, None otherwise."""
    m = _EXPERT_LINEAR.search(_stem(name))
    if m is None:
        return None
    return "shared" if m.group(1) == "shared_experts" else "routed"


def target_of(name: str) -> str | None:
    """The target (``qkv``/``proj``/``fc1``/``fc2``) a base or adapter tensor name belongs to
    (the expert MLPs' linears are ``fc1``/``fc2`` too)."""
    stem = _stem(name)
    m = _EXPERT_LINEAR.search(stem)
    if m is not None:
        return "fc1" if m.group(2) == "dense_h_to_4h" else "fc2"
    for target, module in TARGET_MODULES.items():
        if stem.endswith(module):
            return target
    return None


def slice_rows(target: str, rows: int, cfg: ModelConfig, *, groups: int | None = None,
               q_per_group: int | None = None, routed: bool = False) -> list[torch.Tensor]:  # fmt: skip
    """Row indices of each slice of a fused target's ``rows`` output rows (one A block each).

    QKV: ``[q rows, k rows, v rows]`` of rows ``[groups][q_per_group + 2][d]`` (each list in HF
    head order); SwiGLU fc1: ``[gate half, up half]``, except a ``routed`` expert's (one A for
    its fused gate/up, as PEFT's LoRA on ``experts.gate_up_proj``); otherwise one slice of all
    rows. ``groups`` and ``q_per_group`` default to the full model's (pass a TP rank's for its
    local shard)."""
    idx = torch.arange(rows)
    if target == "qkv":
        g = cfg.query_groups if groups is None else groups
        q = cfg.num_attention_heads // cfg.query_groups if q_per_group is None else q_per_group
        x = idx.view(g, q + 2, cfg.head_dim)
        return [x[:, :q].reshape(-1), x[:, q].reshape(-1), x[:, q + 1].reshape(-1)]
    if target == "fc1" and cfg.swiglu and not routed:
        return list(idx.chunk(2))
    return [idx]


def num_slices(target: str, cfg: ModelConfig, *, routed: bool = False) -> int:
    return 3 if target == "qkv" else 2 if target == "fc1" and cfg.swiglu and not routed else 1


def adapter_shapes(
    target: str, cfg: ModelConfig, rank: int, *, kind: str | None = None
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Full shapes of ``A`` ``[n r, in]`` and ``B`` ``[out, r]`` of ``target`` in model ``cfg``
    (``kind``: :func:`expert_kind` of the tensor, for an expert MLP's width and slices)."""
    h, d = cfg.hidden_size, cfg.head_dim
    ffn = {"routed": cfg.moe_ffn_size, "shared": cfg.moe_shared_expert_intermediate_size}.get(kind or "")
    ffn = cfg.ffn_size if ffn is None else ffn
    out, inp = {
        "qkv": ((cfg.num_attention_heads + 2 * cfg.query_groups) * d, h),
        "proj": (h, cfg.num_attention_heads * d),
        "fc1": ((2 if cfg.swiglu else 1) * ffn, h),
        "fc2": (h, ffn),
    }[target]
    return (num_slices(target, cfg, routed=kind == "routed") * rank, inp), (out, rank)


def _targets(
    model: nn.Module, cfg: LoraConfig
) -> Iterator[tuple[str, str, ColumnParallelLinear | RowParallelLinear]]:
    """(local module name, target, linear) of every linear ``cfg`` adapts."""
    for name, module in model.named_modules():
        for target in cfg.targets:
            if name.endswith(TARGET_MODULES[target]) and isinstance(
                module, ColumnParallelLinear | RowParallelLinear
            ):
                yield name, target, module


def _attention_of(model: nn.Module, qkv_name: str) -> nn.Module:
    return model.get_submodule(qkv_name.rsplit(".", 1)[0])


def add_lora(model: ShardedModule, cfg: LoraConfig, *, seed: int) -> None:
    """Add adapters to ``model``'s target linears in place and freeze every other parameter.

    ``A`` is drawn full on every rank from ``(seed, canonical name)`` and then sliced, so every
    layout starts from the same adapted function; ``B`` starts at zero. On a mixture-of-experts
    model ``fc1``/``fc2`` also adapt every routed expert and the shared expert
    (:mod:`pretrain.models.lora_experts`), never the router. Refused (``UserError``) when TP
    exceeds the number of query groups (replicated key/value heads cannot train), with dropout on
    expert MLPs, or when ``model`` already has adapters."""
    mcfg, ps = model.cfg, model.ps
    if any(is_lora_name(n) for n, _ in model.named_parameters()):
        raise UserError("LoRA: the model already has adapters")
    if "qkv" in cfg.targets and ps.tp_size > mcfg.query_groups:
        raise UserError(
            f"--lora-targets qkv: tensor-parallel size {ps.tp_size} exceeds the {mcfg.query_groups} "
            "query groups (replicated key/value heads); use a smaller --tensor-model-parallel-size"
        )
    if mcfg.sequence_parallel and ps.tp_size > 1:  # adapters read the replicated input of the GEMMs
        raise UserError("LoRA with --sequence-parallel is not supported yet; train the adapters without it")
    mlp = [t for t in cfg.targets if t in ("fc1", "fc2")]
    if mlp and mcfg.num_experts and cfg.dropout > 0.0:  # PEFT's ParamWrapper refuses it too
        raise UserError(
            f"--lora-dropout {cfg.dropout} with --lora-targets {','.join(mlp)} on a mixture-of-experts model: "
            "LoRA on the fused expert weights (PEFT's target_parameters) has no dropout; use --lora-dropout 0"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    model.lora_config = cfg  # type: ignore[assignment]
    for name, target, lin in list(_targets(model, cfg)):
        _attach(model, name, target, lin, cfg, seed=seed)
    attach_expert_adapters(model, rank=cfg.rank, scaling=cfg.scaling, targets=cfg.targets, seed=seed)


def _attach(
    model: ShardedModule,
    name: str,
    target: str,
    lin: ColumnParallelLinear | RowParallelLinear,
    cfg: LoraConfig,
    *,
    seed: int,
) -> None:
    """Give ``lin`` (local module ``name``) its adapter shards and the LoRA forward (in place: the
    class becomes the LoRA subclass, so parameter names and the base weights stay as they are)."""
    mcfg, ps = model.cfg, model.ps
    a_name = adapter_names(model.canonical_name(f"{name}.weight"))[0]
    weight = lin.weight
    column = isinstance(lin, ColumnParallelLinear)
    in_full = weight.shape[1] if column else weight.shape[1] * ps.tp_size
    full_a = init_adapter_a(a_name, (num_slices(target, mcfg) * cfg.rank, in_full), seed=seed)
    local_a = shard_tensor(full_a, dim=None if column else 1, tp_rank=ps.tp_rank, tp=ps.tp_size)
    lora_a = LoraWeight(local_a.to(weight.device), None if column else 1)
    lora_b = LoraWeight(torch.zeros(weight.shape[0], cfg.rank, device=weight.device), 0 if column else None)
    if isinstance(lin, ColumnParallelLinear):
        attn = _attention_of(model, name) if target == "qkv" else None
        rows = slice_rows(
            target, weight.shape[0], mcfg,
            groups=getattr(attn, "groups", None), q_per_group=getattr(attn, "q_per_group", None),
        )  # fmt: skip
        lin.__class__ = LoraColumnParallelLinear
        col = cast(LoraColumnParallelLinear, lin)
        mask = slice_mask(rows, weight.shape[0], weight.device)
        col.register_buffer("lora_slice_mask", mask, persistent=False)  # follows .to()
        col.lora_A, col.lora_B, col.lora_scaling, col.lora_dropout = lora_a, lora_b, cfg.scaling, cfg.dropout
        col.lora_ranges = slice_ranges(mask)
        col.lora_gemm = resolve_cpu_gemm(mcfg.cpu_gemm)
    else:
        lin.__class__ = LoraRowParallelLinear
        row = cast(LoraRowParallelLinear, lin)
        row.lora_rng = ps.rng
        row.lora_A, row.lora_B, row.lora_scaling, row.lora_dropout = lora_a, lora_b, cfg.scaling, cfg.dropout
        row.lora_ranges = ((0, weight.shape[0], 0),)
        row.lora_gemm = resolve_cpu_gemm(mcfg.cpu_gemm)


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters of ``model`` (the only ones the optimizer should see)."""
    return [p for n, p in model.named_parameters() if is_lora_name(n)]


def has_lora(model: nn.Module) -> bool:
    return any(is_lora_name(n) for n, _ in model.named_parameters())


def lora_config_of(model: nn.Module) -> LoraConfig | None:
    """The :class:`LoraConfig` :func:`add_lora` gave ``model``, or None without adapters."""
    cfg = getattr(model, "lora_config", None)
    return cfg if isinstance(cfg, LoraConfig) else None


# --- canonical full tensors -------------------------------------------------------------------
def adapter_delta(
    name: str, a: torch.Tensor, b: torch.Tensor, cfg: ModelConfig, *, scaling: float
) -> torch.Tensor:
    """The full fp32 weight update ``scaling * B A`` ``[out, in]`` of base tensor ``name`` from its
    full adapter ``A [n r, in]``, ``B [out, r]`` (each B row times its slice's A block)."""
    target = target_of(name)
    assert target is not None, name
    a, b = a.float(), b.float()
    r = b.shape[1]
    delta = torch.empty(b.shape[0], a.shape[1])
    for j, rows in enumerate(slice_rows(target, b.shape[0], cfg, routed=expert_kind(name) == "routed")):
        delta[rows] = b[rows] @ a[j * r : (j + 1) * r]
    return delta * scaling


def merged_tensor(
    name: str, weight: torch.Tensor, adapters: Mapping[str, torch.Tensor], cfg: ModelConfig, *, scaling: float
) -> torch.Tensor:
    """Base tensor ``name`` with its adapter merged (``W + scaling B A`` in fp32, cast back to the
    dtype of ``weight``), or ``weight`` itself when ``adapters`` has none for it."""
    a_name, b_name = adapter_names(name)
    if a_name not in adapters and b_name not in adapters:
        return weight
    if a_name not in adapters or b_name not in adapters:
        raise KeyError(f"adapter of {name}: {a_name} and {b_name} come together")
    delta = adapter_delta(name, adapters[a_name], adapters[b_name], cfg, scaling=scaling)
    if delta.shape != weight.shape:
        raise ValueError(f"adapter of {name}: update {tuple(delta.shape)} != weight {tuple(weight.shape)}")
    return (weight.float() + delta).to(weight.dtype)


def merged_state(
    base: Mapping[str, torch.Tensor],
    adapters: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    *,
    scaling: float,
) -> dict[str, torch.Tensor]:
    """Canonical full base tensors with the adapters merged (:func:`merged_tensor`); adapter
    tensors are not in the result. ``KeyError`` names an adapter without its base tensor."""
    out = {
        k: merged_tensor(k, v, adapters, cfg, scaling=scaling) for k, v in base.items() if not is_lora_name(k)
    }
    orphans = sorted(base_name(k) for k in adapters if base_name(k) not in out)
    if orphans:
        raise KeyError(f"adapter of {orphans[0]}: the base has no such tensor")
    return out
