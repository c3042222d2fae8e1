"""Token dispatch to the routed experts, with expert parallelism (megatron-core's all-to-all
dispatcher, without sequence parallelism).

Each of the ``EP`` ranks of an expert-parallel group holds ``E / EP`` consecutive experts (rank j:
global experts ``[j E/EP, (j+1) E/EP)``). A rank's (token, choice) pairs are sorted by expert
(stable), so the pairs for each EP rank are one contiguous block; one all-to-all of the counts
tells every rank how many rows it will receive, a second all-to-all (``all_to_all_single`` with
uneven splits; gloo supports it on the CPU) sends the token rows, the local experts run, and the
reverse all-to-all brings the outputs home, where they are weighted by the router's probabilities
and summed per token. The autograd backward of an all-to-all is the reverse all-to-all.

Which tokens a rank dispatches (megatron-core's semantics with its sequence-parallel shards). With
ETP = TP the expert-TP group is the TP group: every TP rank sends all of its (identical) tokens to
its EP peers of the same TP rank, whose experts hold that TP slice, and the partial outputs are
summed by the MoE layer's TP all-reduce as without EP. Any other ETP: TP rank r dispatches only its
r-th contiguous share of the tokens (megatron-core's sequence-parallel shard) and writes zeros
elsewhere; after the EP all-to-all the expert-TP group all-gathers the rows its ranks received
(each holds an ETP slice of the same experts), runs them, and reduce-scatters the partial outputs
back (megatron-core's all-to-all dispatcher does the same), so each share comes home whole and the
layer's TP all-reduce assembles every token's output (backward, the copy-to-TP-region all-reduce
assembles the input and probability gradients). ETP 1 is the case without the gather.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pretrain.config import ModelConfig
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.mappings import ProcessGroup
from pretrain.utils.errors import UserError


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` in blocks of ``in_splits`` go to the group's ranks in order; the result holds
    the blocks received, ``out_splits`` rows from each rank. Backward: the reverse exchange."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup, out_splits: list[int], in_splits: list[int]
    ) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(
    x: torch.Tensor, group: ProcessGroup, *, out_splits: list[int], in_splits: list[int]
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of the rows of ``x [sum(in_splits), ...]`` over
    ``group``: returns ``[sum(out_splits), ...]``."""
    return _AllToAll.apply(x, group, out_splits, in_splits)  # type: ignore[no-any-return]


def token_share(n: int, tp_rank: int, tp: int) -> tuple[int, int]:
    """``[start, end)`` of TP rank ``tp_rank``'s contiguous share of ``n`` tokens (first shares
    one longer when ``n % tp``, as ``torch.tensor_split``)."""
    per, extra = divmod(n, tp)
    start = tp_rank * per + min(tp_rank, extra)
    return start, start + per + (1 if tp_rank < extra else 0)


def check_expert_parallel(cfg: ModelConfig, ep: int, *, etp: int, tp: int) -> None:
    """:class:`UserError` unless ``ep`` divides the experts and ``etp`` their FFN width (any ETP
    with any ``tp``, as megatron-core; the layout checks the world size)."""
    experts = int(cfg.num_experts or 0)
    if ep > 1 and not experts:
        raise UserError(f"--expert-model-parallel-size {ep} needs a mixture-of-experts model (--num-experts)")
    if experts and experts % ep:
        raise UserError(f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}")
    if experts and cfg.moe_ffn_size % etp:
        raise UserError(
            f"--moe-ffn-hidden-size {cfg.moe_ffn_size} is not divisible by --expert-tensor-parallel-size {etp}"
        )


def _gather_rows(x: torch.Tensor, group: ProcessGroup, sizes: list[int]) -> torch.Tensor:
    """All-gather of ``x [n, h]`` over ``group`` with uneven ``sizes`` (every rank's ``n``, in
    rank order) -> ``[sum(sizes), h]``; backward sums each rank's gradient slice (reduce-scatter).
    An all-to-all of ``n``-row copies, as gloo has no uneven all-gather."""
    copies = x.unsqueeze(0).expand(len(sizes), *x.shape).reshape(-1, *x.shape[1:])
    return all_to_all(copies, group, out_splits=sizes, in_splits=[x.shape[0]] * len(sizes))


def _reduce_scatter_rows(y: torch.Tensor, group: ProcessGroup, sizes: list[int], n: int) -> torch.Tensor:
    """The reverse of :func:`_gather_rows`: ``y [sum(sizes), h]`` partial outputs for every rank's
    rows -> ``[n, h]``, this rank's rows summed over the group (in rank order)."""
    parts = all_to_all(y, group, out_splits=[n] * len(sizes), in_splits=sizes)
    return parts.view(len(sizes), n, *y.shape[1:]).sum(0)


class ExpertDispatcher:
    """Sends each (token, choice) pair to the rank holding its expert and combines the results.

    ``num_local`` experts live here, global indices from ``first_expert``. Collectives over the
    expert-parallel group ``ps.ep_group``: two all-to-alls forward (counts, rows), one back
    (rows), and their reverses in backward; with ETP other than 1 and TP, over the expert-TP
    group ``ps.etp_group`` too: an all-gather of counts and one all-to-all each way (rows).
    """

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        check_expert_parallel(cfg, ps.ep_size, etp=ps.etp_size, tp=ps.tp_size)
        self.num_experts = int(cfg.num_experts or 0)
        self.topk = cfg.moe_router_topk
        self.ep, self.group = ps.ep_size, ps.ep_group
        self.num_local = self.num_experts // self.ep
        self.first_expert = ps.ep_rank * self.num_local
        # ETP != TP: this rank dispatches only its share of the (TP-replicated) tokens
        split = ps.etp_size != ps.tp_size
        self.share = (ps.tp_rank, ps.tp_size) if split and ps.tp_size > 1 else (0, 1)
        self.etp_group = ps.etp_group if split else None  # None: nothing to gather (ETP 1 or = TP)

    def __call__(
        self, x: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor, local: nn.ModuleList
    ) -> torch.Tensor:
        """``x [T, h]``, ``experts``/``probs [T, k]`` (expert ``E``: a slot dropped past capacity,
        skipped) -> the routed output ``[T, h]`` (partial over TP: the caller sums it over the TP
        group)."""
        start, end = token_share(x.shape[0], *self.share)
        if (start, end) != (0, x.shape[0]):
            y = self._combine(x[start:end], experts[start:end], probs[start:end], local)
            return F.pad(y, (0, 0, start, x.shape[0] - end))
        return self._combine(x, experts, probs, local)

    def _combine(
        self, x: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor, local: nn.ModuleList
    ) -> torch.Tensor:
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts + 1)  # [E + 1]: E = dropped slots
        kept = int(counts[: self.num_experts].sum())
        order, counts = order[:kept], counts[: self.num_experts]
        token = order // self.topk
        rows = x[token]  # [kept, h], grouped by expert
        if self.group is None and self.etp_group is None:
            y = torch.cat([expert(p) for expert, p in zip(local, rows.split(counts.tolist()), strict=True)])
        else:
            y = self._exchange(rows, counts, local)
        y = y * probs.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token, y)

    def _exchange(self, rows: torch.Tensor, counts: torch.Tensor, local: nn.ModuleList) -> torch.Tensor:
        """Rows grouped by global expert -> their expert outputs, in the same order, through the
        EP group (each block to the rank owning its experts and back)."""
        ep, nl = self.ep, self.num_local
        if self.group is None:
            return self._run_local(rows, counts.view(1, nl), local)
        recv = torch.empty_like(counts)  # recv[j * nl + i]: rows from rank j for local expert i
        dist.all_to_all_single(recv, counts, group=self.group)
        sent = counts.view(ep, nl).sum(1).tolist()
        got = recv.view(ep, nl).sum(1).tolist()
        received = all_to_all(rows, self.group, out_splits=got, in_splits=sent)
        back = self._run_local(received, recv.view(ep, nl), local)
        return all_to_all(back, self.group, out_splits=sent, in_splits=got)

    def _run_local(self, rows: torch.Tensor, got_by: torch.Tensor, local: nn.ModuleList) -> torch.Tensor:
        """``rows`` in blocks of ``got_by [S, nl]`` (source, local expert) order -> their outputs in
        the same order; with an expert-TP group to gather over, every ETP rank's blocks run here
        on this rank's ETP slice and the partial outputs are summed back (reduce-scatter)."""
        if self.etp_group is not None:
            peers = [torch.empty_like(got_by) for _ in range(dist.get_world_size(self.etp_group))]
            dist.all_gather(peers, got_by.contiguous(), group=self.etp_group)
            sizes = [int(p.sum()) for p in peers]
            out = self._run_blocks(_gather_rows(rows, self.etp_group, sizes), torch.cat(peers), local)
            return _reduce_scatter_rows(out, self.etp_group, sizes, rows.shape[0])
        return self._run_blocks(rows, got_by, local)

    @staticmethod
    def _run_blocks(rows: torch.Tensor, got_by: torch.Tensor, local: nn.ModuleList) -> torch.Tensor:
        """``rows`` in blocks of ``got_by [S, nl]`` -> each local expert's output on its blocks, in
        the same (source, local expert) order."""
        sources, nl = got_by.shape
        blocks = rows.split(got_by.reshape(-1).tolist())
        outs = [
            local[i](torch.cat([blocks[j * nl + i] for j in range(sources)])).split(got_by[:, i].tolist())
            for i in range(nl)
        ]
        return torch.cat([outs[i][j] for j in range(sources) for i in range(nl)])
