"""The Hugging Face ``config.json`` columns of the option table (:data:`pretrain.model_options.OPTIONS`):
each family group's one-to-one keys, the values its architecture fixes (export refusals), the
switches a family sets and the per-layer modules an option adds."""

from __future__ import annotations

from pretrain.config import ModelConfig
from pretrain.model_options import BY_FIELD, OPTIONS, Option

Groups = str | tuple[str, ...]


def _deciding_group(option: Option, groups: Groups) -> str | None:
    """The group whose column (``hf`` key or ``hf_fixed`` value) speaks for ``option``: the last of
    ``groups`` that has one (a layered group such as ``("llama", "mixtral")`` overrides its base)."""
    names = (groups,) if isinstance(groups, str) else groups
    return next((g for g in reversed(names) if g in option.hf or g in option.hf_fixed), None)


def hf_unsupported(cfg: ModelConfig, group: Groups, architecture: str) -> list[str]:
    """``field=value (ARCHITECTURE has ...)`` for every option whose value family ``group``'s
    architecture cannot hold (the :attr:`Option.hf_fixed` column), in table order."""
    out = []
    for option in OPTIONS:
        g = _deciding_group(option, group) if option.field else None
        if option.field and g is not None and g in option.hf_fixed:
            value, what = option.hf_fixed[g]
            if getattr(cfg, option.field) != value:
                out.append(f"{option.field}={getattr(cfg, option.field)} ({architecture} {what})")
    return out


def family_switches(model_type: str) -> dict[str, object]:
    """The ``ModelConfig`` values the Hugging Face family ``model_type`` fixes (the
    :attr:`Option.switches` column, in table order)."""
    return {o.field: o.switches[model_type] for o in OPTIONS if o.field and model_type in o.switches}


def absent_modules(cfg: ModelConfig) -> tuple[str, ...]:
    """The per-layer modules (:attr:`Option.tensors`) ``cfg`` lacks because their option is off."""
    return tuple(t for o in OPTIONS if o.field and o.tensors and not getattr(cfg, o.field) for t in o.tensors)


def _keyed(group: Groups) -> list[tuple[str, str]]:
    """(field, ``config.json`` key) of every option with a one-to-one key in ``group`` (layered)."""
    out = []
    for option in OPTIONS:
        g = _deciding_group(option, group) if option.field else None
        if option.field and g is not None and g in option.hf:
            out.append((option.field, option.hf[g]))
    return out


def hf_kwargs(cfg: ModelConfig, group: Groups) -> dict[str, object]:
    """The one-to-one ``config.json`` keys of family ``group`` for ``cfg``. Layered groups may map
    two fields to one key (Mixtral's ``intermediate_size`` is the expert width, llama's the dense
    width): the later group's field wins."""
    out: dict[str, object] = {}
    names = (group,) if isinstance(group, str) else group
    for g in names:  # base first, so a later group's key replaces it
        out.update((key, getattr(cfg, field)) for field, key in _keyed(group) if _owner(field, group) == g)
    return out


def _owner(field: str, group: Groups) -> str | None:
    return _deciding_group(BY_FIELD[field], group)


def config_kwargs_from_hf(hf_config: object, group: Groups) -> dict[str, object]:
    """The ``ModelConfig`` fields of family ``group``'s one-to-one keys present in ``hf_config``."""
    return {field: getattr(hf_config, key) for field, key in _keyed(group) if hasattr(hf_config, key)}
