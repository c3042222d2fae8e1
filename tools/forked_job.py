"""Work that holds the GIL (imports, pure-Python object building) run in a forked child process
beside a parent whose own work runs mostly outside it (tensor copies and writes).

On a thread the two contend for the GIL: ``to-hf`` of a 1B checkpoint made transformers' config and
tokenizer objects (about 2.3 s of imports) on a thread while it wrote the weights, and the weights
took 2.3 s longer than with transformers already imported, so the thread overlapped nothing. A
forked child has its own interpreter and runs on the other core.

Never worse than doing the work in the parent: where ``fork`` is unavailable, or the child dies
of anything but a :class:`UserError`, or it has not finished ``timeout`` seconds after the parent
asks for it (a fork beside running threads can deadlock on a lock one of them held), the work runs
again in the parent, where a real error surfaces as usual. A :class:`UserError` of the child is
raised in the parent with its message (one line, as if the parent had raised it).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable

from pretrain.utils.errors import UserError

__all__ = ["ForkedJob"]

_USER_ERROR = b"U"  # first byte of the child's report: a UserError's message follows


class ForkedJob:
    """``work()`` started in a forked child now; :meth:`wait` for it; :meth:`cancel` if unneeded.

    ``work`` must leave its results outside the process (files): the child's memory is its own.
    With ``fork=False`` (or no ``os.fork``) nothing starts and :meth:`wait` runs ``work`` itself.
    """

    def __init__(self, work: Callable[[], object], *, fork: bool = True) -> None:
        self._work = work
        self._pid: int | None = None
        self._report_fd: int | None = None
        if fork and hasattr(os, "fork"):
            self._start()

    def _start(self) -> None:
        read_fd, write_fd = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
            stream.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(read_fd)
            self._child(write_fd)
        os.close(write_fd)
        self._pid, self._report_fd = pid, read_fd

    def _child(self, report_fd: int) -> None:
        code = 0
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no Rust thread pool after fork
            self._work()
        except UserError as exc:
            os.write(report_fd, _USER_ERROR + str(exc).encode())
            code = 1
        except BaseException:  # noqa: BLE001 - the parent runs the work again and sees it itself
            code = 2
        finally:
            os._exit(code)  # no atexit handlers, no flush of the parent's inherited buffers

    def wait(self, timeout: float = 120.0) -> None:
        """Until the work is done (the child's, or the parent's own run of it); the child's
        :class:`UserError` raised here."""
        if self._pid is None:
            self._work()
            return
        status = self._reap(timeout)
        message = self._read_report()
        if status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            return
        if message.startswith(_USER_ERROR):
            raise UserError(message[1:].decode(errors="replace"))
        self._work()  # killed, crashed or stuck: do it here, where any real error shows itself

    def cancel(self) -> None:
        """End the child if it still runs (the parent failed or was interrupted)."""
        if self._pid is not None:
            with contextlib.suppress(ProcessLookupError):  # it has just exited
                os.kill(self._pid, signal.SIGKILL)
            self._reap(None)
            self._read_report()

    def _reap(self, timeout: float | None) -> int | None:
        """The child's wait status; ``None`` if it was still running after ``timeout`` (then killed)."""
        assert self._pid is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self._pid, 0 if deadline is None else os.WNOHANG)
            if pid:
                self._pid = None
                return status
            if deadline is not None and time.monotonic() >= deadline:
                os.kill(self._pid, signal.SIGKILL)
                os.waitpid(self._pid, 0)
                self._pid = None
                return None
            time.sleep(0.01)

    def _read_report(self) -> bytes:
        if self._report_fd is None:
            return b""
        chunks = []
        while select.select([self._report_fd], [], [], 0)[0]:
            chunk = os.read(self._report_fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(self._report_fd)
        self._report_fd = None
        return b"".join(chunks)
