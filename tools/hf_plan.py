"""The plan of a streaming Hugging Face export: which HF tensors each layer group makes, in order.

:func:`stream_hf_tensors` turns a source of canonical tensors (``names()`` + ``tensor(name)``, e.g.
a memory-mapped checkpoint reader) into Hugging Face tensors one transformer layer at a time: the
model-specific mapping (``canonical -> HF``, a function of a whole state dict) is called with the
layer's real tensors and every other tensor as a ``meta`` placeholder (shape only, no memory), and
the outputs that came out real are the layer's HF tensors. So one mapping table serves every family
(GPT-2, Llama/Mistral/Qwen, MoE, BERT) and at most one layer is converted at a time.

:func:`plan_hf_tensors` finds, before any data is read, what that stream yields (names, dtypes,
shapes, in order: a safetensors header is written before its data) from a dry run on shapes alone
(:mod:`~pretrain.utils.shape_probe`).
Layers whose groups are alike (the same one-layer mapping, names, dtypes and shapes) share one dry
run, renamed per layer: planning costs one layer of each kind, not every layer.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from pretrain.checkpoint.tensor_meta import meta_like
from pretrain.checkpoint.types import ColumnPieces, RowPieces
from pretrain.utils.errors import UserError
from pretrain.utils.shape_probe import ShapeProbeMode

__all__ = ["HFPlan", "LocalGroup", "Planned", "layer_groups", "plan_hf_tensors", "stream_hf_tensors"]

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def layer_groups(names: Sequence[str]) -> list[list[str]]:
    """Canonical names grouped by transformer layer (in order), then the rest (embeddings, heads)."""
    groups: dict[int, list[str]] = {}
    rest = []
    for n in names:
        m = _LAYER.search(n)
        if m is None:
            rest.append(n)
        else:
            groups.setdefault(int(m.group(1)), []).append(n)
    return [*(groups[i] for i in sorted(groups)), *([rest] if rest else [])]


Convert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Planned:
    """One tensor as a safetensors header announces it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize


@dataclass(frozen=True)
class HFPlan:
    """What :func:`stream_hf_tensors` yields, in order (``tensors``), per layer group each output
    with the one canonical tensor it is made from (``None``: it needs several), and per group how
    to convert it alone (:class:`LocalGroup`; ``None``: with every other tensor as a placeholder)."""

    tensors: list[Planned]
    groups: list[list[tuple[str, str | None]]]
    local: list[LocalGroup | None] = field(default_factory=list)
    outputs: frozenset[str] = frozenset()  # every HF name (empty: not known)


LayerConvert = Callable[[int], Convert | None]  # layer i -> the mapping of a one-layer model like it


@dataclass(frozen=True)
class LocalGroup:
    """One layer group converted as the only layer of a one-layer model: the whole-model mapping
    called once per canonical tensor costs each call every other layer's placeholders (seconds per
    model), this costs one layer's. Checked against the whole-model mapping on placeholders when
    planned (same outputs, names, dtypes and shapes), so the tensors and their order are the same."""

    convert: Convert
    metas: dict[str, torch.Tensor]  # the one-layer model's placeholders
    names: dict[str, str]  # this group's canonical name -> its name in the one-layer model
    outputs: dict[str, str]  # the one-layer model's HF name -> the HF name it stands for

    def run(self, real: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``_real_outputs`` of the whole-model mapping for ``real`` (tensors of this group); a
        refusal (e.g. an all-zero router) names the tensor as the checkpoint does, not the one-layer
        model's name for it."""
        try:
            made = _real_outputs(self.convert, self.metas, {self.names[n]: t for n, t in real.items()})
        except UserError as exc:
            message = str(exc)
            for name in sorted(self.names, key=lambda n: len(self.names[n]), reverse=True):
                message = message.replace(self.names[name], name)
            raise UserError(message) from None
        out = {self.outputs[k]: t for k, t in made.items()}
        return {k: out[k] for k in self.outputs.values() if k in out}  # the whole-model order


def _real_outputs(
    convert: Convert, metas: dict[str, torch.Tensor], real: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    mapping = dict(metas)
    mapping.update(real)
    return {k: t for k, t in convert(mapping).items() if t.device.type != "meta"}


def _one_source_each(group: list[tuple[str, str | None]]) -> bool:
    """Every output has one source tensor, and each source's outputs come one after another."""
    sources = [src for _, src in group]
    runs = [s for i, s in enumerate(sources) if i == 0 or s != sources[i - 1]]
    return None not in sources and len(runs) == len(set(runs))


def stream_hf_tensors(
    names: Sequence[str], get: Callable[[str], torch.Tensor], convert: Convert,
    metas: dict[str, torch.Tensor] | None = None, plan: HFPlan | None = None,
    wanted: set[str] | None = None, row_pieces: Callable[[str], RowPieces | None] | None = None,
    column_pieces: Callable[[str], ColumnPieces | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor | RowPieces | ColumnPieces]]:  # fmt: skip
    """``(hf_name, tensor)`` for every output of ``convert`` (canonical dict -> HF dict), computed one
    layer group at a time; ``metas``: each canonical tensor's dtype and shape on the ``meta`` device
    (default: ``meta_like(get(name))``, reading every tensor once more). With ``plan``, a group whose
    outputs each come from one canonical tensor is converted one tensor at a time, in the same order
    (memory: one canonical tensor and its outputs, not the layer's), and a group the plan can
    convert alone (:class:`LocalGroup`) is. ``wanted`` (with ``plan``): only these outputs, in the
    same order; a group with none of them is not read. ``row_pieces`` (with ``plan``): a source
    tensor's row blocks where it has them; an output that is whole rows of one is yielded as
    :class:`RowPieces` of those blocks (:mod:`tools.hf_row_select`: nothing joined or copied).
    ``column_pieces`` (with ``row_pieces``): a source tensor's column blocks where it has them; an
    output that is that tensor unchanged is yielded as those :class:`ColumnPieces`."""
    if metas is None:
        metas = {n: meta_like(get(n)) for n in names}
    expected = set(plan.outputs) if plan is not None and plan.outputs else set(convert(dict(metas)))
    seen: set[str] = set()
    planned = {} if plan is None or row_pieces is None else {t.name: t for t in plan.tensors}  # built once
    if wanted is not None:
        assert plan is not None, "wanted needs the plan"
        expected &= wanted
    for i, group in enumerate(layer_groups(names)):
        if plan is not None and wanted is not None and not any(hf in wanted for hf, _ in plan.groups[i]):
            continue
        local = plan.local[i] if plan is not None and i < len(plan.local) else None
        run = local.run if local is not None else functools.partial(_real_outputs, convert, metas)
        if plan is not None and _one_source_each(plan.groups[i]):
            yield from _one_source_outputs(
                plan, i, run, get, wanted, (row_pieces, column_pieces), seen, planned
            )
            continue
        try:
            out = run({n: get(n) for n in group})
        except (RuntimeError, NotImplementedError) as exc:  # an output mixing layers: cannot stream
            raise RuntimeError(f"the HF mapping combines tensors of several layers ({exc})") from exc
        for hf_name, t in out.items():
            if hf_name not in seen and (wanted is None or hf_name in wanted):
                seen.add(hf_name)
                yield hf_name, t
        del out
    if seen != expected:
        raise RuntimeError(f"HF tensors not produced by any single layer: {sorted(expected - seen)[:5]}")


Run = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def _one_source_outputs(
    plan: HFPlan, i: int, run: Run, get: Callable[[str], torch.Tensor], wanted: set[str] | None,
    stored: tuple[Callable[[str], RowPieces | None] | None, Callable[[str], ColumnPieces | None] | None],
    seen: set[str], planned: dict[str, Planned],
) -> Iterator[tuple[str, torch.Tensor | RowPieces | ColumnPieces]]:  # fmt: skip
    """Group ``i`` of ``plan``, whose outputs each come from one tensor, one source tensor at a
    time (its outputs are dropped before the next is read); row selections as :class:`RowPieces`,
    pass-throughs of stored column blocks as :class:`ColumnPieces` (``stored``: the source's
    ``row_pieces`` and ``column_pieces``)."""
    by_source: dict[str, list[str]] = {}
    for hf_name, src in plan.groups[i]:
        assert src is not None
        if wanted is None or hf_name in wanted:
            by_source.setdefault(src, []).append(hf_name)
    for src, outs in by_source.items():
        found = (
            _where_they_lie(run, src, [planned[n] for n in outs], stored) if stored[0] is not None else None
        )
        made: dict[str, torch.Tensor | RowPieces | ColumnPieces]
        if found is None:  # joined and converted as a whole (the join releases its own pages)
            made, release = dict(run({src: get(src)})), None
        else:
            made, release = dict(found[0]), found[1]
        for hf_name in outs:
            seen.add(hf_name)
            yield hf_name, made.pop(hf_name)
        if release is not None:
            release()  # every output of this source is written: its pages go


def _where_they_lie(
    run: Run, src: str, outs: list[Planned],
    stored: tuple[Callable[[str], RowPieces | None] | None, Callable[[str], ColumnPieces | None] | None],
) -> tuple[dict[str, RowPieces | ColumnPieces], Callable[[], None] | None] | None:  # fmt: skip
    """``src``'s outputs ``outs`` as the source's stored blocks (and the blocks' page release), or
    ``None`` where the mapping does more than select its rows or pass it through."""
    from tools.hf_row_select import row_selected, unchanged

    row_pieces, column_pieces = stored
    rows = row_pieces(src) if row_pieces is not None else None
    selected = None if rows is None else row_selected(run, src, rows, outs)
    if rows is not None and selected is not None:
        return dict(selected), rows.release
    columns = column_pieces(src) if column_pieces is not None else None
    same = None if columns is None else unchanged(run, src, columns, outs)
    if columns is None or same is None:
        return None
    return {same: columns}, columns.release


def _sources(run: Run, group: list[str], outputs: list[str],
             fake: Callable[[str], torch.Tensor]) -> list[tuple[str, str | None]]:  # fmt: skip
    """Each of a group's ``outputs`` with the one tensor of ``group`` that alone makes it real."""
    source: dict[str, str] = {}
    for n in group:
        try:
            made = run({n: fake(n)})
        except Exception:  # noqa: BLE001  # e.g. meta mixed with a real tensor: not alone
            continue
        for hf_name in made:
            source.setdefault(hf_name, n)
    return [(hf_name, source.get(hf_name)) for hf_name in outputs]


def _global_name(local_name: str, layer: int) -> str:
    """A one-layer model's HF name as layer ``layer``'s: the first index in it is the layer's
    (``model.layers.0.mlp.experts.3.w1``, ``transformer.h.0.attn``, ``bert.encoder.layer.0.output``)."""
    return local_name.replace(".0.", f".{layer}.", 1)


@dataclass(frozen=True)
class _Traced:
    """One layer group's dry run in the names of its one-layer model: what the whole group makes
    (HF name -> dtype, shape) and what each of its tensors makes alone (``None``: it cannot)."""

    made: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    alone: dict[str, list[str] | None]


_TraceKey = tuple[Convert, tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]]


def _trace(convert: Convert, local: dict[str, torch.Tensor], fakes: dict[str, torch.Tensor]) -> _Traced:
    """The dry run of a group of fake tensors ``fakes`` (one-layer names) among ``local``."""
    made = _real_outputs(convert, local, fakes)
    alone: dict[str, list[str] | None] = {}
    for m, fake in fakes.items():
        try:
            alone[m] = list(_real_outputs(convert, local, {m: fake}))
        except Exception:  # noqa: BLE001  # e.g. meta mixed with a real tensor: not alone
            alone[m] = None
    return _Traced({k: (t.dtype, tuple(t.shape)) for k, t in made.items()}, alone)


def _local_group(group: list[str], metas: dict[str, torch.Tensor], hf_metas: dict[str, torch.Tensor],
                 layer_convert: LayerConvert, fake: Callable[[str], torch.Tensor],
                 memo: dict[_TraceKey, _Traced]) -> tuple[LocalGroup, _Traced] | None:  # fmt: skip
    """Layer group ``group`` as the only layer of a one-layer model with its dry run, or ``None``
    when that model's mapping does not make the same tensors (names, dtypes, shapes) as the whole
    model's. The dry run is ``memo``'s when a group alike was traced (same mapping object, one-layer
    names, dtypes and shapes: the same computation)."""
    layers = {int(m.group(1)) if m is not None else None for m in map(_LAYER.search, group)}
    if len(layers) != 1:
        return None
    layer = layers.pop()  # None: the embeddings, final norm and heads, converted beside layer 0
    convert = layer_convert(layer or 0)
    if convert is None:
        return None
    names = {n: _LAYER.sub(".layers.0.", n, count=1) for n in group}
    local = {n: t for n, t in metas.items() if (m := _LAYER.search(n)) is None or int(m.group(1)) == 0}
    local.update({names[n]: metas[n] for n in group})
    key = (convert, tuple((names[n], metas[n].dtype, tuple(metas[n].shape)) for n in group))
    if key not in memo:
        memo[key] = _trace(convert, local, {names[n]: fake(n) for n in group})
    traced = memo[key]
    outputs = {k: k if layer is None else _global_name(k, layer) for k in traced.made}
    for k, g in outputs.items():
        if g not in hf_metas or (hf_metas[g].dtype, tuple(hf_metas[g].shape)) != traced.made[k]:
            return None
    if len(set(outputs.values())) != len(outputs):
        return None
    order = {g: j for j, g in enumerate(hf_metas)}
    outputs = dict(sorted(outputs.items(), key=lambda kv: order[kv[1]]))
    return LocalGroup(convert, local, names, outputs), traced


def _traced_sources(lg: LocalGroup, traced: _Traced, group: list[str],
                    outputs: list[str]) -> list[tuple[str, str | None]]:  # fmt: skip
    """:func:`_sources` of a local group, read from its dry run."""
    source: dict[str, str] = {}
    for n in group:
        made = traced.alone[lg.names[n]]
        if made is None or any(k not in lg.outputs for k in made):  # LocalGroup.run would fail
            continue
        for k in made:
            source.setdefault(lg.outputs[k], n)
    return [(hf_name, source.get(hf_name)) for hf_name in outputs]


def plan_hf_tensors(names: Sequence[str], metas: dict[str, torch.Tensor], convert: Convert,
                    layer_convert: LayerConvert | None = None) -> HFPlan | None:  # fmt: skip
    """What :func:`stream_hf_tensors` will yield, in order, from a dry run on fake tensors (shapes
    only: no data read, no memory); ``None`` when the mapping cannot run on them. With
    ``layer_convert`` each layer group is, where it checks out, converted alone (:class:`LocalGroup`);
    ``layer_convert`` giving the same mapping object for alike layers lets them share a dry run."""
    try:
        hf_metas = convert(dict(metas))  # on placeholders alone: cheaper outside the probe mode
        with ShapeProbeMode():  # fakes are probes: what comes out as one was made from them alone

            def fake(name: str) -> torch.Tensor:
                return torch.empty(metas[name].shape, dtype=metas[name].dtype)

            groups, local, seen = [], [], set()
            memo: dict[_TraceKey, _Traced] = {}
            for group in layer_groups(names):
                found = None if layer_convert is None else _local_group(group, metas, hf_metas, layer_convert,
                                                                       fake, memo)  # fmt: skip
                if found is not None:
                    lg, traced = found
                    outs = [n for n in lg.outputs.values() if n not in seen]
                    sources = _traced_sources(lg, traced, group, outs)
                else:
                    lg, run = None, functools.partial(_real_outputs, convert, metas)
                    outs = [n for n in run({n: fake(n) for n in group}) if n not in seen]
                    sources = _sources(run, group, outs, fake)
                seen.update(outs)
                groups.append(sources)
                local.append(lg)
    except Exception:  # noqa: BLE001  # e.g. a data-dependent step: write without a plan
        return None
    if seen != set(hf_metas):
        return None
    # the order the stream yields, with the placeholders' dtypes and shapes (a real tensor unlike its
    # placeholder only costs the writer a header rewrite: ShardWriter checks every add)
    tensors = [Planned(n, hf_metas[n].dtype, tuple(hf_metas[n].shape)) for g in groups for n, _ in g]
    return HFPlan(tensors, groups, local, frozenset(hf_metas))
