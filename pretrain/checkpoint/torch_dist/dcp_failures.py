"""Failures inside ``torch.distributed.checkpoint`` (dcp) save and load, as our own errors.

dcp runs each step of a save or load under a wrapper that catches *every* ``BaseException`` (a
Ctrl-C and our :class:`UserError` included) and raises ``CheckpointException`` instead: itself a
``BaseException`` whose text is a multi-rank traceback. Left alone, a Ctrl-C during a
``torch_dist`` write or read, or a truncated ``.distcp`` file, reaches the user as a 60-line
traceback with exit code 1. :func:`dcp_failures` unwraps it: the interrupt is raised again as
``KeyboardInterrupt`` (``cli_entry`` prints ``interrupted``, exit 130, and ``atomic_directory``
has already removed the partial output), our own errors pass through, anything else becomes one
:class:`UserError` line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from pretrain.utils.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (torch's messages run on for several sentences)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _cause(exc: CheckpointException) -> BaseException:
    """The first rank's original exception (dcp keeps ``(exception, stack summary)`` per rank)."""
    for wrapped in exc.failures.values():
        if isinstance(wrapped, tuple) and wrapped and isinstance(wrapped[0], BaseException):
            return wrapped[0]
    return exc


@contextlib.contextmanager
def dcp_failures(describe: Callable[[BaseException], str]) -> Iterator[None]:
    """Run a dcp load (or save); its failures leave as ``KeyboardInterrupt``, ``SystemExit``, our
    own :class:`UserError`, or ``UserError(describe(original exception))`` (one line naming the file).
    (Used only around dcp calls: importing dcp here costs nothing more.)"""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        cause = _cause(exc)
        if isinstance(cause, (KeyboardInterrupt, SystemExit, UserError)):
            raise cause from None
        raise UserError(describe(cause)) from None
