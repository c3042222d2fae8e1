"""``mlm-convert`` (the console script ``tools.convert_cli:console_main``; also ``python -m tools.convert_cli``).

The commands live in :mod:`tools.convert`: ``cli`` (flags and dispatch), ``source`` (opening a checkpoint
and its tokenizer), ``inspect_ckpt``, ``reshard``, ``to_hf``, ``from_hf`` and ``writing`` (what the
writing commands share).
"""

from __future__ import annotations

import os
from typing import NoReturn

from pretrain.utils.console import run_console_script
from tools.convert.cli import TARGET_DESTS, TARGET_FLAGS, build_parser, main
from tools.convert.to_hf import DEFAULT_MAX_SHARD_SIZE

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "TARGET_DESTS", "TARGET_FLAGS", "build_parser", "console_main", "main"]


def console_main() -> NoReturn:
    """The command line's entry: :func:`main`, then exit without the interpreter's ~1 s teardown
    (:mod:`pretrain.utils.console`). Call :func:`main` to run a command in-process.

    OpenMP's idle threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE`` unless set; read
    when torch loads libgomp, after this): a conversion's parallel regions are short copies between
    file writes, and the spinning after each cost a 1B reshard 2.7 of its 7.9 CPU seconds on a
    2-core host (same wall time; the CPU is what other work on the host gets back)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    run_console_script(main)


if __name__ == "__main__":
    console_main()
