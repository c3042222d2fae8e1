"""How a console-script process runs: huge pages for big tensors, torch imported without the
collector, and an exit without teardown.

**Huge pages.** A conversion allocates a fresh buffer for every full tensor it assembles (hundreds
of MB each). glibc serves blocks above 32 MB with a new ``mmap``, so each one costs a page fault
and a zero-fill per 4 KiB page on first touch: concatenating two 100 MB halves ran 3.4x faster
with 2 MiB pages on this host (10 x 200 MB ``torch.cat``: 2.6 s -> 0.77 s). Torch's CPU allocator
asks for transparent huge pages (``madvise``) when ``THP_MEM_ALLOC_ENABLE=1``;
:func:`prefer_huge_pages` sets it unless the user chose otherwise. The kernel's
``transparent_hugepage`` setting still decides (``never`` turns it off).

**Import.** Importing torch makes ~200k objects, and the cyclic garbage collector runs a
collection of every generation many times over them while it does: 0.3-0.6 s of the ~2 s import
on this host. :func:`import_torch_frozen` imports it with the collector paused, then moves every
object alive to the permanent generation (``gc.freeze``: module-level objects, alive to the end
anyway), so the collections of what the command builds later (transformers' import included) no
longer walk torch's objects. The collector stays on for everything made afterwards.

**Exit.** After a conversion the interpreter holds torch, transformers and their ~300k objects. Its normal
exit tears every module down and runs a full garbage collection over all of them: about a second
of a 1B-parameter ``to-hf`` on a 2-core host (measured: 1.15 s of 12.5 s), spent after the last
byte is on disk. :func:`exit_after_cleanup` does what exit must do for correctness and skips the
rest:

* ``threading._shutdown`` joins non-daemon threads and shuts thread pools down (as the interpreter
  does first on exit);
* the ``atexit`` handlers run (temporary directories, ``logging`` handlers, torch's own hooks);
* ``stdout``/``stderr`` are flushed;
* then ``os._exit``: no module teardown, no final collection.

Files are closed (and renamed into place) by the commands themselves before they return, so
nothing buffered in Python is lost. Only console-script entry points call this; a ``main`` called
in-process (tests, notebooks) returns as before.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def prefer_huge_pages() -> None:
    """Ask torch's CPU allocator for transparent huge pages for large blocks, unless
    ``THP_MEM_ALLOC_ENABLE`` is already set (read by torch when it first allocates such a block)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def import_torch_frozen() -> None:
    """Import torch with the cyclic garbage collector paused, then freeze every object alive into
    the permanent generation (see the module docstring); nothing when torch is imported already."""
    if "torch" in sys.modules:
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        import torch  # noqa: F401
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def exit_after_cleanup(code: int) -> NoReturn:
    """Join threads, run ``atexit`` handlers, flush the standard streams, then ``os._exit(code)``."""
    shutdown = getattr(threading, "_shutdown", None)  # what Py_Finalize calls first (CPython)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can be said
            stream.flush()
    os._exit(code)


def run_console_script(main: Callable[[], int | None]) -> NoReturn:
    """Run a console script's ``main`` with :func:`prefer_huge_pages`, and exit as
    :func:`exit_after_cleanup` does.

    ``SystemExit`` raised inside keeps its meaning: an int (or None: 0) is the exit code, a
    message is printed to stderr with code 1, as the interpreter would. Any other exception
    propagates with its traceback and the normal (slow) exit: that is a bug, not a finished command.
    """
    prefer_huge_pages()
    try:
        result = main()
    except SystemExit as exc:
        result = exc.code  # type: ignore[assignment]
    if result is None:
        code = 0
    elif isinstance(result, int):
        code = result
    else:
        print(result, file=sys.stderr)
        code = 1
    exit_after_cleanup(code)
