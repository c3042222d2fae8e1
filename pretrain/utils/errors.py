"""User-facing errors: one clear message, no traceback."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Callable
from functools import wraps
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., int | None])


class UserError(Exception):
    """An error caused by user input (a file, flag, field or tensor), printed as one line.

    The message must name the offending file, field, tensor or flag.
    """


_command_end: list[Callable[[], None]] = []  # run when the outermost cli_entry command ends
_depth = 0  # cli_entry commands running (one ``main`` may call another)


def at_command_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running ``cli_entry`` command ends, however it ends (e.g. release
    an output lock). Outside a command it is not kept: the caller's own exit handling applies."""
    if _depth > 0 and callback not in _command_end:
        _command_end.append(callback)


def cli_entry(func: F) -> F:
    """Wrap a CLI ``main`` so that :class:`UserError` prints ``error: ...`` and exits with code 2,
    and Ctrl-C prints ``interrupted`` and exits with code 130."""

    @wraps(func)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        global _depth
        _depth += 1
        try:
            return func(*args, **kwargs)
        except UserError as exc:
            if first_report(str(exc)):
                print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise SystemExit(130) from None
        finally:
            _depth -= 1
            while _depth == 0 and _command_end:
                _command_end.pop()()

    return wrapper  # type: ignore[return-value]


def first_report(message: str) -> bool:
    """False when another rank of this ``torchrun`` launch already printed the same message.

    Every rank usually hits the same bad input; the first to report it creates a marker file
    (``O_EXCL``) named by the launch's ``TORCHELASTIC_RUN_ID`` and the message, the others stay
    silent. Outside torchrun (no run id) every error is printed.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or os.environ.get("WORLD_SIZE", "1") == "1":
        return True
    digest = hashlib.sha256(f"{run_id}\0{message}".encode()).hexdigest()[:24]
    marker = os.path.join(tempfile.gettempdir(), f"mlm-toolkit-error-{digest}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True
