"""Run a command's ``main`` in a fresh process with one function made slow, for tests that act on a
run in progress (a Ctrl-C during a write, a second writer of the same output).

    python -m tests.slow_hook MODULE:QUALNAME MARKER CLI_MODULE [ARG ...]

The first call of ``QUALNAME`` (a function or method of ``MODULE``) creates the file ``MARKER``
and waits, up to two minutes, until the test removes it; then the run goes on. A SIGINT ends the
wait as it would end real work. The process exits with ``CLI_MODULE.main(ARGS)``'s code.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HOLD_S = 120.0


def _slowed(func: Callable[..., Any], marker: Path) -> Callable[..., Any]:
    called = False

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal called
        if not called:
            called = True
            marker.write_text("in progress")
            end = time.monotonic() + HOLD_S
            while marker.exists() and time.monotonic() < end:  # a signal is handled within 50 ms
                time.sleep(0.05)
        return func(*args, **kwargs)

    return wrapper


def install(target: str, marker: Path) -> None:
    """Replace ``MODULE:QUALNAME`` by its slowed version."""
    module_name, _, qualname = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, name, _slowed(getattr(owner, name), marker))


def main() -> int:
    target, marker, cli_module, *argv = sys.argv[1:]
    # A shell's background job starts with SIGINT ignored; the tests send a real Ctrl-C.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    install(target, Path(marker))
    code = importlib.import_module(cli_module).main(argv)
    return int(code or 0)


# --- for the tests ---------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]


def start_held(hook: str, marker: Path, cli_module: str, argv: list[str]) -> subprocess.Popen[str]:
    """Start ``CLI_MODULE ARGV`` with ``hook`` slowed; return once the hook holds it (``marker`` exists)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tests.slow_hook", hook, str(marker), cli_module, *argv]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + HOLD_S
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            out, err = proc.communicate(timeout=60)
            raise AssertionError(f"{hook} was never reached (exit {proc.returncode}):\n{out}{err[-3000:]}")
        time.sleep(0.05)
    return proc


if __name__ == "__main__":
    sys.exit(main())
