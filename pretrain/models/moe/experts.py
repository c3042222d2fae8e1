"""Expert MLPs: each a Megatron MLP (fc1 column-parallel, fc2 row-parallel) whose TP collectives
are left to the mixture-of-experts layer, so that all experts of a layer share one all-reduce.

Canonical names (full tensors, global expert index ``e``), in the legacy naming of the layer:
``mlp.experts.{e}.dense_h_to_4h.weight`` ``[2 I, h]`` with SwiGLU (rows ``[gate; up]``) or
``[I, h]``, and ``mlp.experts.{e}.dense_4h_to_h.weight`` ``[h, I]``; the shared expert is
``mlp.shared_experts.dense_h_to_4h/dense_4h_to_h.weight`` and its gate ``mlp.shared_experts.gate_weight``
``[1, h]`` (megatron-core's names).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config import ModelConfig
from pretrain.models.norms import DTYPES
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.layers import mark_partition


class LocalLinear(nn.Module):
    """``weight`` of one shard of ``tp`` (default: the TP size), split along ``dim`` (0: output
    rows, 1: input columns; whole when ``tp`` is 1); no collective: the caller owns the TP region
    around a group of these."""

    def __init__(
        self,
        out_features: int,
        in_features: int,
        *,
        dim: int,
        cfg: ModelConfig,
        ps: ParallelState,
        tp: int | None = None,
    ) -> None:
        super().__init__()
        tp = ps.tp_size if tp is None else tp
        shape = [out_features, in_features]
        shape[dim] //= tp
        kw: dict[str, Any] = {"device": ps.device, "dtype": DTYPES[cfg.params_dtype]}
        self.weight = mark_partition(nn.Parameter(torch.empty(*shape, **kw)), dim if tp > 1 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ExpertMLP(nn.Module):
    """One expert of width ``ffn`` on this rank's slice of ``tp`` (default: the TP size; a routed
    expert uses the expert TP size): input ``[n, h]`` (inside the TP region), output ``[n, h]``
    *partial* (summed over the TP group by the caller)."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState, ffn: int, *, tp: int | None = None) -> None:
        super().__init__()
        fc1_rows = 2 * ffn if cfg.swiglu else ffn
        self.dense_h_to_4h = LocalLinear(fc1_rows, cfg.hidden_size, dim=0, cfg=cfg, ps=ps, tp=tp)
        self.dense_4h_to_h = LocalLinear(cfg.hidden_size, ffn, dim=1, cfg=cfg, ps=ps, tp=tp)
        self.swiglu = cfg.swiglu
        self.squared_relu = cfg.squared_relu
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dense_h_to_4h(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        elif self.squared_relu:
            y = F.relu(y).square()
        else:
            y = F.gelu(y, approximate=self.approximate)
        return self.dense_4h_to_h(y)  # type: ignore[no-any-return]


class SharedExpertMLP(ExpertMLP):
    """The always-on shared expert; with ``moe_shared_expert_gate`` its output is scaled by
    ``sigmoid(x . gate_weight)`` (``gate_weight [1, h]``, replicated on TP ranks)."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__(cfg, ps, int(cfg.moe_shared_expert_intermediate_size or 0))
        if cfg.moe_shared_expert_gate:
            kw: dict[str, Any] = {"device": ps.device, "dtype": DTYPES[cfg.params_dtype]}
            self.gate_weight = mark_partition(nn.Parameter(torch.empty(1, cfg.hidden_size, **kw)), None)

    def gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """``sigmoid(x . gate_weight)`` ``[n, 1]`` for replicated input ``x [n, h]``, or None."""
        if not hasattr(self, "gate_weight"):
            return None
        return torch.sigmoid(F.linear(x, self.gate_weight))
