"""``mlm-eval``: zero-shot evaluation, contamination and leaderboard reports.

Each subcommand lives in its own module exposing ``register(subparsers) -> None``; the
registered parser sets ``func`` (called with the parsed namespace, returns an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pretrain.utils.errors import cli_entry

SUBCOMMAND_MODULES = (
    "mlm_eval.wikitext_cli",
    "mlm_eval.lambada_cli",
    "mlm_eval.contamination",
    "mlm_eval.report",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlm-eval", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
