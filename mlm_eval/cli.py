"""``mlm-eval``: zero-shot evaluation, contamination and leaderboard reports.

Each subcommand lives in its own module exposing ``register(subparsers) -> None``; the
registered parser sets ``func`` (called with the parsed namespace, returns an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from pretrain.utils.cli import OneLineParser
from pretrain.utils.errors import cli_entry

SUBCOMMAND_MODULES = (
    "mlm_eval.tasks.wikitext_cli",
    "mlm_eval.tasks.lambada_cli",
    "mlm_eval.contamination.cli",
    "mlm_eval.report.cli",
)
# Each subcommand's name and one-line help, so that ``mlm-eval --help`` imports none of them
# (they pull in torch and transformers); the chosen subcommand's module is imported alone.
SUBCOMMANDS = {
    "wikitext103": ("mlm_eval.tasks.wikitext_cli", "WikiText-103 perplexity (paper or lm-eval method)"),
    "lambada": ("mlm_eval.tasks.lambada_cli", "LAMBADA cloze accuracy (strict, or --last-token)"),
    "contamination": ("mlm_eval.contamination.cli", "share of eval n-grams found in training corpora"),
    "report": ("mlm_eval.report.cli", "leaderboard of result records (terminal, markdown, CSV, HTML)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``command`` only that subcommand's module is imported (others are stubs)."""
    parser = OneLineParser(prog="mlm-eval", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    known = {module for module, _ in SUBCOMMANDS.values()}
    for name, (module_name, helptext) in SUBCOMMANDS.items():
        if command is None or command == name:
            _register(sub, module_name)
        else:
            sub.add_parser(name, help=helptext)
    for module_name in SUBCOMMAND_MODULES:  # modules without an entry in SUBCOMMANDS: always imported
        if module_name not in known and (command is None or command not in SUBCOMMANDS):
            _register(sub, module_name)
    return parser


def _register(sub: Any, name: str) -> None:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return
    module.register(sub)


def _command(argv: list[str]) -> str | None:
    """The subcommand named on the command line; "" for a bare ``--help`` (import nothing)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return ""


@cli_entry
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(_command(argv)).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
