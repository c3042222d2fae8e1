"""Which process of a ``torchrun -n N mlm-convert`` launch writes which output file, and how they agree.

A conversion's outputs (HF shard files, target rank files, ``torch_dist`` chunks) are known from
its plan before any tensor is read. :func:`split_by_bytes` gives each a rank by a pure function of
their sizes (contiguous runs of about equal bytes), so every process computes the same assignment
alone and reads only the source tensors of its own outputs: no tensor crosses processes.

All ranks write into one temporary directory beside ``--save`` (:meth:`WorkSplit.directory`);
rank 0 writes what describes the whole (index, metadata, tracker, tokenizer, config) once every
rank's files are written, and renames the directory. Every collective goes through
:meth:`WorkSplit.agree`, which tells each rank whether any rank failed: a failure on one rank makes
all of them raise the same one-line error (printed once, exit 2), rank 0 removes the temporary
directory, and no rank waits forever for one that has given up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

from pretrain.utils.atomic import atomic_directory, replace_directory, temporary_directory_for
from pretrain.utils.errors import UserError

# A rank may wait at a collective while another still writes its (larger) files; a process that
# dies is ended by torchrun, which stops the others, so the wait needs no short limit.
_TIMEOUT = timedelta(hours=24)
T = TypeVar("T")


def split_by_bytes(sizes: Sequence[int], world: int) -> list[int]:
    """The rank of each output, in order: ``world`` contiguous runs of about equal bytes.

    Output ``i`` goes to the rank whose share ``[r/world, (r+1)/world)`` of the total holds the
    middle of its bytes, so ranks never decrease along the list (each rank's outputs are one run,
    e.g. whole pipeline stages) and a rank may get none when one output outweighs a share."""
    total = sum(sizes)
    if total <= 0:
        return [min(world - 1, i * world // max(1, len(sizes))) for i in range(len(sizes))]
    out, before = [], 0
    for size in sizes:
        out.append(min(world - 1, (2 * before + size) * world // (2 * total)))
        before += size
    return out


@dataclass
class _Agreement:
    failed: bool = False  # a failure was agreed: no rank calls another collective


@dataclass(frozen=True, kw_only=True)
class WorkSplit:
    """This process's share of a conversion: ``rank`` of ``world`` (1: one process does it all)."""

    rank: int = 0
    world: int = 1
    state: _Agreement = field(default_factory=_Agreement, compare=False)

    @property
    def leader(self) -> bool:
        """Rank 0: writes the files that describe the whole output, prints, renames."""
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world > 1

    @classmethod
    def from_env(cls) -> WorkSplit:
        """One process, or (``WORLD_SIZE`` > 1, under torchrun) this rank after joining the gloo group."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=_TIMEOUT)
        return cls(rank=dist.get_rank(), world=dist.get_world_size())

    def close(self) -> None:
        """Leave the process group (every rank, at the end of the command)."""
        if self.parallel:
            import torch.distributed as dist

            if dist.is_initialized():
                if not self.state.failed:  # (a failure already ended with a barrier: _end_together)
                    # every rank is done (rank 0's rename and index included) before any tears the
                    # group down: a rank leaving while a peer still works has aborted gloo
                    # ("terminate called without an active exception") on a loaded host
                    with contextlib.suppress(BaseException):
                        dist.barrier()
                dist.destroy_process_group()

    def owners(self, sizes: Sequence[int]) -> list[int]:
        """Each output's rank (:func:`split_by_bytes`)."""
        return split_by_bytes(sizes, self.world)

    def mine(self, sizes: Sequence[int]) -> list[bool]:
        """Whether this rank writes each output."""
        return [r == self.rank for r in self.owners(sizes)]

    def agree(self, error: BaseException | None = None) -> None:
        """Collective: returns once every rank got here without failing (:meth:`gather`)."""
        self.gather(None, error)

    def gather(self, payload: T, error: BaseException | None = None) -> list[T]:
        """Collective: every rank's ``payload`` in rank order, once no rank failed.

        ``error``: this rank failed (it is raised again here). When another rank failed, raises
        :class:`UserError` with its message (the same line on every rank, printed once); after a
        failure is agreed no rank calls another collective (:meth:`guard`)."""
        if not self.parallel:
            if error is not None:
                raise error
            return [payload]
        import torch.distributed as dist

        message = None if error is None else _message(error)
        gathered: list[tuple[str | None, T]] = [(None, payload)] * self.world
        dist.all_gather_object(gathered, (message, payload))
        failed = [m for m, _ in gathered if m is not None]
        if failed:
            self.state.failed = True
            if error is not None:
                raise error
            raise UserError(failed[0])
        return [p for _, p in gathered]

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around a whole command: a rank failing between collectives still joins the next one the
        others wait at (with its failure), so all of them stop together."""
        try:
            yield
        except BaseException as exc:
            if self.parallel:
                with contextlib.suppress(BaseException):
                    if not self.state.failed:
                        self.agree(exc)
                    self._end_together()
            raise

    def _end_together(self) -> None:
        """After an agreed failure: wait until every rank got here (rank 0 has removed the temporary
        directory), then let none be cut short by torchrun's SIGTERM, which it sends the others
        when the first ends: each finishes printing and exits 2 itself, a moment later."""
        import signal

        import torch.distributed as dist

        dist.barrier()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    @contextlib.contextmanager
    def directory(self, save: Path) -> Iterator[Path]:
        """The temporary directory every rank writes into, renamed to ``save`` by rank 0 when all of
        them succeeded (one process: :func:`atomic_directory`). Collectives: one on entry (all ranks
        ready; rank 0 names the directory), one on exit (all ranks done)."""
        if not self.parallel:
            with atomic_directory(save) as single:
                yield single
            return
        tmp: Path | None = None
        try:
            made = str(temporary_directory_for(save)) if self.leader else None
            tmp = Path(str(self.gather(made)[0]))
            yield tmp
            self.agree()  # every rank's files are written
        except BaseException as exc:
            if not self.state.failed:
                with contextlib.suppress(BaseException):
                    self.agree(exc)
            if self.leader and tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.leader:
            assert tmp is not None
            replace_directory(tmp, save)


def _message(error: BaseException) -> str:
    if isinstance(error, UserError):
        return str(error)
    return f"{type(error).__name__}: {error}".splitlines()[0]


SINGLE = WorkSplit()  # one process does it all
