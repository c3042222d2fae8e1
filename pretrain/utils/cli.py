"""Argument parsing at the edge: one-line errors for unknown or inconsistent flags."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """``argparse`` that reports errors as one ``prog: error: ...`` line and exits with code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)
