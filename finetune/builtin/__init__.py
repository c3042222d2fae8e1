"""Tiny built-in finetuning data sets in the official formats, for demos and tests.

* ``sst2_tiny``: SST-2 ``train.tsv`` / ``dev.tsv`` (``sentence<TAB>label``), sentiment carried by
  clearly positive or negative adjectives.
* ``squad_tiny`` / ``squad2_tiny``: SQuAD 1.1 / 2.0 ``train.json`` / ``dev.json``.
* ``race_tiny``: RACE ``{train,dev,test}/{high,middle}/*.txt``.

``mlm-finetune --data-dir builtin:NAME`` names one without knowing where the package lies (how
``tools/demo.py`` runs it, without importing this package). All are generated deterministically by :mod:`finetune.builtin.generate` (``python -m
finetune.builtin.generate`` rewrites them).
"""

from __future__ import annotations

from pathlib import Path

from pretrain.utils.errors import UserError

BUILTIN_TASKS = ("sst2_tiny", "squad_tiny", "squad2_tiny", "race_tiny")


def builtin_task_dir(name: str) -> Path:
    """Directory of the built-in data set ``name`` (one of :data:`BUILTIN_TASKS`)."""
    if name not in BUILTIN_TASKS:
        raise UserError(f"unknown built-in data set {name!r}; expected one of {', '.join(BUILTIN_TASKS)}")
    path = Path(__file__).resolve().parent / name
    if not path.is_dir():
        raise UserError(f"built-in data set {name} is missing from the installation ({path})")
    return path


def resolve_data_dir(value: str) -> str:
    """``--data-dir`` as a directory: ``builtin:NAME`` is :func:`builtin_task_dir` ``(NAME)``, any other
    value is returned unchanged."""
    if not value.startswith("builtin:"):
        return value
    name = value.removeprefix("builtin:")
    if name not in BUILTIN_TASKS:
        raise UserError(f"--data-dir {value}: no such built-in data set (one of {', '.join(BUILTIN_TASKS)})")
    return str(builtin_task_dir(name))
