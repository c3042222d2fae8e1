"""``mlm-lm-eval``: lm-evaluation-harness's own command line with the ``mlm`` model registered.

Every ``lm_eval`` flag works unchanged::

    mlm-lm-eval --model mlm --model_args ckpt=DIR,dtype=bf16,batch_size=16 --tasks hellaswag
    torchrun --nproc-per-node 4 -m mlm_eval.harness --model mlm --model_args ckpt=DIR,tp=2,pp=2 --tasks ...

lm-eval 0.4.13 resolves ``--model`` only against models imported into its registry, with no
plugin discovery; harness versions that read the ``lm_eval.models`` entry-point group (declared
in our ``pyproject.toml``) find ``mlm`` from the plain ``lm_eval`` command too. This command
registers every installed ``lm_eval.models`` entry point lazily, then runs the harness.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import sys

from pretrain.utils.errors import cli_entry


def register_entry_points() -> list[str]:
    """Register each ``lm_eval.models`` entry point the harness does not know yet; their names."""
    from lm_eval.api.registry import model_registry

    names = []
    for ep in md.entry_points(group="lm_eval.models"):
        if ep.name not in model_registry:
            model_registry.register(ep.name, target=f"{ep.module}:{ep.attr}")
            names.append(ep.name)
    return names


def _mlm_model_args(argv: list[str]) -> dict[str, object] | None:
    """``--model_args`` as the harness will parse them when ``--model`` is ours (``{}`` when not
    given); ``None`` for another model or arguments the harness parses otherwise (it reports those)."""
    from lm_eval.utils import simple_parse_args_string

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model")
    parser.add_argument("--model_args")
    known, _ = parser.parse_known_args(argv)
    if known.model not in ("mlm", "mlm-toolkit"):
        return None
    text = (known.model_args or "").strip()
    if text.startswith("{"):  # harness versions that take JSON model_args
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return None
        return parsed if isinstance(parsed, dict) else None
    return dict(simple_parse_args_string(text)) if text else {}


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Run the harness CLI (``lm_eval``'s ``cli_evaluate``) with our backend available."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from mlm_eval.harness.backend import check_model_args  # registers "mlm" even when not pip-installed

    model_args = _mlm_model_args(sys.argv[1:])
    if model_args is not None:  # before the harness spends seconds indexing and loading its tasks
        check_model_args(model_args)
    register_entry_points()
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
