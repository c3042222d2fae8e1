"""``mlm-convert`` (the console script ``tools.convert_cli:main``; also ``python -m tools.convert_cli``).

The commands live in :mod:`tools.convert`: ``cli`` (flags and dispatch), ``source`` (opening a checkpoint
and its tokenizer), ``inspect_ckpt``, ``reshard``, ``to_hf``, ``from_hf`` and ``writing`` (what the
writing commands share).
"""

from __future__ import annotations

import sys

from tools.convert.cli import TARGET_DESTS, TARGET_FLAGS, build_parser, main
from tools.convert.to_hf import DEFAULT_MAX_SHARD_SIZE

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "TARGET_DESTS", "TARGET_FLAGS", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
