"""User-facing errors: one clear message, no traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., int | None])


class UserError(Exception):
    """An error caused by user input (a file, flag, field or tensor), printed as one line.

    The message must name the offending file, field, tensor or flag.
    """


def cli_entry(func: F) -> F:
    """Wrap a CLI ``main`` so that :class:`UserError` prints ``error: ...`` and exits with code 2."""

    @wraps(func)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return func(*args, **kwargs)
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise SystemExit(130) from None

    return wrapper  # type: ignore[return-value]
