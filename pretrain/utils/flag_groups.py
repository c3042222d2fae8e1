"""Command-line flags derived from typed configs: one shared set for every command.

A frozen keyword-only dataclass describes a group of flags; :func:`add_flag_group` turns it into an
``argparse`` argument group and :func:`flags_from_namespace` builds the dataclass back from the parsed
namespace, so what travels from the parser into a command is a typed object, never a loose dict.

Per field: the flag is ``--field-name`` (or ``metadata["flags"]``, e.g. Megatron's
``--tensor-model-parallel-size`` with the short alias ``--tp``), the type comes from the annotation
(``int``, ``float``, ``str``, ``Path``, ``X | None``, ``Literal[...]`` as choices, ``bool`` as a
``store_true`` switch), the help from ``metadata["help"]`` with the default appended
(``(default: 1)``), and a bad value is argparse's one-line error with exit 2.

Each shared group lives with the component that owns it: the parallel layout is
:class:`pretrain.parallel.config.ParallelConfig` itself, the weights' dtype :class:`pretrain.config.DTypeFlags`,
the tokenizer :class:`pretrain.tokenizer.flags.TokenizerFlags` (``mlm-pretrain``, ``mlm-eval``,
``mlm-finetune``, ``mlm-convert``, ``mlm-generate`` and ``mlm-layout`` use the fields they need:
``include`` picks them, ``dests`` keeps a command's existing attribute names). This module is only the
machinery and imports nothing above ``pretrain.utils``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Literal, TypeVar

from pretrain.utils.errors import UserError

T = TypeVar("T")


def flag_meta(help_text: str, **extra: Any) -> dict[str, Any]:
    """A field's ``metadata``: its help, and optionally ``flags`` (option strings), ``metavar``, ``choices``."""
    return {"help": help_text, **extra}


def _strip_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else str
    return tp


def _argparse_kwargs(f: dataclasses.Field[Any], annotation: Any) -> dict[str, Any]:
    tp = _strip_optional(annotation)
    default = f.default
    kwargs: dict[str, Any] = {"default": default}
    help_text = f.metadata.get("help", "")
    if tp is bool:
        kwargs["action"] = "store_true"
        kwargs["help"] = help_text
        return kwargs
    if typing.get_origin(tp) is Literal:
        kwargs["choices"] = typing.get_args(tp)
        tp = type(typing.get_args(tp)[0])
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
    if "metavar" in f.metadata:
        kwargs["metavar"] = f.metadata["metavar"]
    kwargs["type"] = tp
    kwargs["help"] = f"{help_text} (default: {default})" if default is not None else help_text
    return kwargs


def add_flag_group(
    parser: argparse.ArgumentParser,
    cls: type[Any],
    *,
    title: str,
    include: tuple[str, ...] | None = None,
    dests: Mapping[str, str] | None = None,
    flags: Mapping[str, tuple[str, ...]] | None = None,
    defaults: Mapping[str, Any] | None = None,
    required: tuple[str, ...] = (),
    group: Any = None,
) -> Any:
    """Add ``cls``'s fields (those in ``include``; all when ``None``) as flags to a new argument group
    titled ``title`` (or to ``group``); ``dests``/``flags``/``defaults`` override a field's attribute
    name, option strings and default; fields in ``required`` must be given. Returns the group."""
    hints = typing.get_type_hints(cls)
    target = group if group is not None else parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if include is not None and f.name not in include:
            continue
        kwargs = _argparse_kwargs(f, hints[f.name])
        if defaults and f.name in defaults:
            kwargs["default"] = defaults[f.name]
            if "help" in kwargs and kwargs.get("action") != "store_true":
                kwargs["help"] = f"{f.metadata.get('help', '')} (default: {defaults[f.name]})"
        if f.name in required:
            kwargs["required"] = True
            kwargs["help"] = f.metadata.get("help", "")
            kwargs.pop("default", None)
        option_strings = (
            (flags or {}).get(f.name) or f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)
        )
        target.add_argument(*option_strings, dest=(dests or {}).get(f.name, f.name), **kwargs)
    return target


def flags_from_namespace(
    cls: type[T], ns: argparse.Namespace, *, dests: Mapping[str, str] | None = None
) -> T:
    """The ``cls`` instance a parsed namespace holds; fields the command did not add keep their defaults."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        dest = (dests or {}).get(f.name, f.name)
        if hasattr(ns, dest):
            values[f.name] = getattr(ns, dest)
    return cls(**values)


@contextlib.contextmanager
def renamed_flag_errors(cls: type[Any], flags: Mapping[str, tuple[str, ...]]) -> Iterator[None]:
    """Re-raise a :class:`UserError` naming ``cls``'s shared flags (``--tp``) with this command's
    names for them (``flags``, as given to :func:`add_flag_group`: ``--target-tp``).

    Checks deep in the engine (``ModelConfig.check_tensor_parallel``, ``ParallelConfig``) name the
    shared flags; a command that spells them otherwise must not send the user to a flag it lacks.
    """
    names: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        if f.name in flags:
            for option in f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),):
                names[option] = flags[f.name][0]
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")(?![\w-])")
    try:
        yield
    except UserError as exc:
        raise UserError(pattern.sub(lambda m: names[m.group(1)], str(exc))) from None
