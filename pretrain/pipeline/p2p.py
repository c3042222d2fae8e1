"""Point-to-point exchange of activations and their gradients between neighbouring stages.

All transfers use ``torch.distributed.batch_isend_irecv`` over the pipeline group. Sends are
posted without waiting (their requests are kept and completed later), and a rank blocks only on
the receive it needs next. Because each schedule table is a prefix-consistent order of one global
dataflow, every blocking receive's matching send is posted by a rank that is not itself waiting
on this one, so the steady-state cross exchange cannot deadlock. Activations and gradients use
separate tags, keeping the two streams in order even when the next and the previous stage are
the same rank (p = 2 with interleaving).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pretrain.parallel.state import ParallelState

ACTIVATION_TAG = 1
GRADIENT_TAG = 2


class PipelineComm:
    """Sends and receives ``[b, s, h]`` tensors to the previous / next pipeline stage (ring order)."""

    def __init__(self, ps: ParallelState) -> None:
        self.ps = ps
        ranks = ps.pp_ranks
        r = ps.pp_rank
        self.next_rank = ranks[(r + 1) % len(ranks)]
        self.prev_rank = ranks[(r - 1) % len(ranks)]
        self.pending: list[tuple[dist.Work, torch.Tensor | None]] = []

    def _post(self, op: object, tensor: torch.Tensor, peer: int, tag: int) -> list[dist.Work]:
        return dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, self.ps.pp_group, tag)])  # type: ignore[arg-type]

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, *, from_next: bool) -> torch.Tensor:
        """Receive a gradient from the next stage or an activation from the previous one."""
        buf = torch.empty(shape, dtype=dtype, device=self.ps.device)
        peer, tag = (self.next_rank, GRADIENT_TAG) if from_next else (self.prev_rank, ACTIVATION_TAG)
        for work in self._post(dist.irecv, buf, peer, tag):
            work.wait()
        return buf

    def send(self, tensor: torch.Tensor, *, to_next: bool, free_after: torch.Tensor | None = None) -> None:
        """Post a send; ``free_after`` (the autograd output) has its data released once it is sent."""
        peer, tag = (self.next_rank, ACTIVATION_TAG) if to_next else (self.prev_rank, GRADIENT_TAG)
        for work in self._post(dist.isend, tensor.detach().contiguous(), peer, tag):
            self.pending.append((work, free_after))
        self.poll()

    def poll(self) -> None:
        """Complete finished sends and free the outputs they carried (only grad_fn is kept)."""
        still = []
        for work, out in self.pending:
            if work.is_completed():
                work.wait()
                _free(out)
            else:
                still.append((work, out))
        self.pending = still

    def wait_all(self) -> None:
        for work, out in self.pending:
            work.wait()
            _free(out)
        self.pending = []


def _free(out: torch.Tensor | None) -> None:
    # Megatron's deallocate_output_tensor: backward needs the output's grad_fn, not its data.
    if out is not None:
        out.data = torch.empty((1,), device=out.device, dtype=out.dtype)
