"""Model flags derived from the option table (:data:`pretrain.model_options.OPTIONS`): Megatron's
spellings. ``mlm-pretrain`` takes every option's flag with ``ModelConfig``'s defaults
(:func:`add_model_flags`); a command that starts from a loaded model (``mlm-finetune``) takes some
of them as overrides of the model's values (:func:`add_model_override_flags`)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping

from pretrain.config import ModelConfig
from pretrain.model_options import BY_FIELD, OPTIONS
from pretrain.utils.errors import UserError

FLAG_FIELDS = tuple(o.field for o in OPTIONS if o.field and o.flag is not None)


def add_model_flags(group: argparse._ArgumentGroup) -> None:
    """Every option's ``mlm-pretrain`` flag (Megatron's names), plus ``--group-query-attention`` /
    ``--num-query-groups`` (Megatron's two-flag GQA). Defaults are ``ModelConfig``'s."""
    for name in FLAG_FIELDS:
        _add_option_flag(group, name, default=_default(name))
    group.add_argument("--group-query-attention", action="store_true")
    group.add_argument("--num-query-groups", type=int, default=None,
                       help="key-value heads (with --group-query-attention)")  # fmt: skip


def config_kwargs_from_flags(ns: argparse.Namespace) -> dict[str, object]:
    """The ``ModelConfig`` fields of the flags of :func:`add_model_flags` (``ModelConfig`` validates)."""
    if ns.num_query_groups is not None and not ns.group_query_attention:
        raise UserError("--num-query-groups needs --group-query-attention (as in Megatron-LM)")
    if ns.position_embedding_type != "rope" and (ns.use_rope_scaling or ns.rotary_percent != 1.0):
        raise UserError("--use-rope-scaling / --rotary-percent need --position-embedding-type rope")
    out: dict[str, object] = {name: getattr(ns, name) for name in FLAG_FIELDS}
    out["num_query_groups"] = (ns.num_query_groups or 1) if ns.group_query_attention else None
    return out


def add_model_override_flags(
    group: argparse._ArgumentGroup, fields: tuple[str, ...], *, defaults: Mapping[str, object] | None = None
) -> None:
    """The table's flags of ``fields`` as overrides of a loaded model's config: a flag left out
    gives None (keep the model's value) unless ``defaults`` names the command's own default."""
    defaults = defaults or {}
    for name in fields:
        flag = BY_FIELD[name].flag
        shown = f"default: {defaults[name]}" if name in defaults else "default: the model's"
        text = f"{flag.help}; {shown}" if flag is not None and flag.help else shown
        _add_option_flag(group, name, default=defaults.get(name), help_text=text)


def model_overrides_from_flags(ns: argparse.Namespace, fields: tuple[str, ...]) -> dict[str, object]:
    """The ``ModelConfig`` fields among ``fields`` that :func:`add_model_override_flags`' flags set."""
    return {name: getattr(ns, name) for name in fields if getattr(ns, name) is not None}


def _add_option_flag(
    group: argparse._ArgumentGroup, name: str, *, default: object, help_text: str | None = None
) -> None:
    """The option table's flag of ``name`` (its spellings, kind, type and choices) into ``group``;
    ``help_text`` replaces the table's help."""
    flag = BY_FIELD[name].flag
    if flag is None:
        raise ValueError(f"option {name} has no flag in the option table")
    help_text = help_text or flag.help or None
    if flag.kind != "value":
        group.add_argument(*flag.names, dest=name, action=flag.kind, default=default, help=help_text)
    elif flag.required:
        group.add_argument(*flag.names, dest=name, type=_field_type(name), required=True, help=help_text)
    else:
        group.add_argument(*flag.names, dest=name, type=flag.parse or _field_type(name), choices=flag.choices,
                           default=default, help=help_text)  # fmt: skip


def _default(name: str) -> object:
    default = next(f.default for f in dataclasses.fields(ModelConfig) if f.name == name)
    return None if default is dataclasses.MISSING else default


def _field_type(name: str) -> Callable[[str], object]:
    annotation = str(next(f.type for f in dataclasses.fields(ModelConfig) if f.name == name))
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str
