"""The one executor that runs any schedule table (:mod:`pretrain.pipeline.schedule_table`).

``forward_backward`` runs this rank's table over its model chunks. A microbatch is a dict with
at least ``tokens [b, s]`` (present on every stage: shapes of received activations come from it)
and whatever ``loss_fn`` needs (``labels``, ``loss_mask``). ``loss_fn(per_token_losses, mb)``
returns the scalar that is back-propagated; to match one process on the whole batch it should
be the masked sum divided by the loss-token count of the whole global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pretrain.models.base import ShardedModule
from pretrain.models.forward_context import ForwardContext
from pretrain.models.moe.layer import set_aux_loss_scale
from pretrain.parallel.state import ParallelState
from pretrain.pipeline.p2p import PipelineComm
from pretrain.pipeline.schedule_table import Action, build_table

Microbatch = dict[str, torch.Tensor]
LossFn = Callable[[Any, Microbatch], torch.Tensor]
ForwardStep = Callable[[ShardedModule, Microbatch, "torch.Tensor | None", bool], Any]


def gpt_forward_step(model: ShardedModule, mb: Microbatch, hidden: torch.Tensor | None, is_last: bool) -> Any:
    """GPT stage forward: ids (first stage) or received hidden states; per-token losses on the last."""
    kwargs: dict[str, Any] = {"hidden_states": hidden} if hidden is not None else {"input_ids": mb["tokens"]}
    ctx = ForwardContext(position_ids=mb.get("position_ids"))
    return model(labels=mb["labels"] if is_last else None, ctx=ctx, **kwargs)


def _detach(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detach(o) for o in out)
    if isinstance(out, dict):
        return {k: _detach(v) for k, v in out.items()}
    return out


def _backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Backward from ``output`` whose data may have been freed (skips autograd's shape check)."""
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
    grads = (grad,) if grad is not None else (torch.ones_like(output),)
    engine.run_backward((output,), grads, False, False, (), True, True)


class _Executor:
    def __init__(
        self, chunks: Sequence[ShardedModule], ps: ParallelState, mbs: Sequence[Microbatch], loss_fn: LossFn,
        forward_only: bool, collect_outputs: bool, forward_step: ForwardStep,
    ) -> None:  # fmt: skip
        self.chunks, self.ps, self.mbs, self.loss_fn = chunks, ps, mbs, loss_fn
        self.forward_step = forward_step
        self.forward_only, self.collect = forward_only, collect_outputs
        self.comm = PipelineComm(ps) if ps.pp_size > 1 else None
        self.saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.losses: list[torch.Tensor] = []
        self.outputs: list[Any] = []
        self.max_inflight = 0

    def _first(self, chunk: int) -> bool:
        return self.ps.is_first_stage and chunk == 0

    def _last(self, chunk: int) -> bool:
        return self.ps.is_last_stage and chunk == len(self.chunks) - 1

    def _hidden_shape(self, mb: Microbatch) -> tuple[int, ...]:
        """``[b, s, h]``, or this rank's sequence shard ``[b, s/t, h]`` under sequence parallelism."""
        b, s = mb["tokens"].shape
        cfg = self.chunks[0].cfg
        if cfg.sequence_parallel:
            s //= self.ps.tp_size
        return (b, s, cfg.hidden_size)

    def forward(self, a: Action) -> None:
        mb, model = self.mbs[a.microbatch], self.chunks[a.chunk]
        inp = None
        if not self._first(a.chunk):
            assert self.comm is not None
            inp = self.comm.recv(self._hidden_shape(mb), _param_dtype(model), from_next=False)
            inp.requires_grad_(not self.forward_only)
        with torch.set_grad_enabled(not self.forward_only):
            out = self.forward_step(model, mb, inp, self._last(a.chunk))
            if self._last(a.chunk):
                if self.collect:
                    self.outputs.append(_detach(out))
                out = self.loss_fn(out, mb)
                self.losses.append(out.detach())
            else:
                assert self.comm is not None
                self.comm.send(out, to_next=True, free_after=None if self.forward_only else out)
        if not self.forward_only:
            self.saved[(a.microbatch, a.chunk)] = (inp, out)
            self.max_inflight = max(self.max_inflight, len(self.saved))

    def backward(self, a: Action) -> None:
        inp, out = self.saved.pop((a.microbatch, a.chunk))
        grad = None
        if not self._last(a.chunk):
            assert self.comm is not None
            grad = self.comm.recv(tuple(inp.shape) if inp is not None else self._hidden_shape(self.mbs[a.microbatch]),
                                  out.dtype, from_next=True)  # fmt: skip
        _backward(out, grad)
        if inp is not None:
            assert self.comm is not None and inp.grad is not None
            self.comm.send(inp.grad, to_next=False)


def _param_dtype(model: ShardedModule) -> torch.dtype:
    return next(model.parameters()).dtype


def forward_backward(
    *,
    chunks: Sequence[ShardedModule],
    ps: ParallelState,
    microbatches: Sequence[Microbatch],
    loss_fn: LossFn,
    forward_only: bool = False,
    finalize_grads: Callable[[], None] | None = None,
    microbatch_group_size: int | None = None,
    collect_outputs: bool = False,
    forward_step: ForwardStep = gpt_forward_step,
    schedule: str = "1f1b",
    stats: dict[str, Any] | None = None,
    loss_scale: float = 1.0,
) -> tuple[list[torch.Tensor], list[Any]]:
    """Run this rank's schedule; returns ``(losses, outputs)`` on the last stage.

    ``forward_step(model, mb, received_hidden_or_None, is_last_stage)`` runs one stage (default:
    GPT, returning per-token losses on the last stage). ``losses`` are the detached ``loss_fn``
    values per microbatch (microbatch order on the last stage); ``outputs`` are the detached
    last-stage outputs when ``collect_outputs``. ``finalize_grads`` (data-parallel and embedding gradient sync) is called
    exactly once, after the last backward. ``schedule`` is ``1f1b`` (interleaved when several
    chunks) or ``fthenb``; ``stats`` receives ``max_inflight`` (peak stored activations).
    ``loss_scale``: the fp16 loss scale ``loss_fn`` applies; mixture-of-experts router losses get
    their gradient scaled alike, divided by microbatches x DP (Megatron's aux-loss scaling).
    Collectives: p2p over the pipeline group.
    """
    if not forward_only:
        set_aux_loss_scale(chunks, loss_scale / (len(microbatches) * ps.dp_size))
    table = build_table(
        p=ps.pp_size, r=ps.pp_rank, m=len(microbatches), vp=len(chunks), group=microbatch_group_size,
        train=not forward_only, kind=schedule,
    )  # fmt: skip
    ex = _Executor(chunks, ps, microbatches, loss_fn, forward_only, collect_outputs, forward_step)
    for action in table:
        ex.forward(action) if action.kind == "F" else ex.backward(action)
    if ex.comm is not None:
        ex.comm.wait_all()
    if not forward_only and finalize_grads is not None:
        finalize_grads()
    if stats is not None:
        stats["max_inflight"] = ex.max_inflight
    return ex.losses, ex.outputs
