"""Streaming Hugging Face export: sharded safetensors written tensor by tensor, never the whole model.

:func:`stream_hf_tensors` turns a source of canonical tensors (``names()`` + ``tensor(name)``, e.g. a
memory-mapped checkpoint reader) into Hugging Face tensors one transformer layer at a time: the
model-specific mapping (``canonical -> HF``, a function of a whole state dict) is called with the
layer's real tensors and every other tensor as a ``meta`` placeholder (shape only, no memory), and
the outputs that came out real are the layer's HF tensors. So one mapping table serves every family
(GPT-2, Llama/Mistral/Qwen, BERT) and at most one layer is converted at a time.

:class:`ShardWriter` writes them as ``save_pretrained`` does: ``model.safetensors`` when everything
fits in ``max_shard_size``, else ``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``). Each tensor's
bytes go straight to the shard's data file; the shard is closed by writing its safetensors header
and appending the data with a kernel-side copy (``os.copy_file_range``), so resident memory stays
about one layer.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from pretrain.checkpoint.tensor_meta import meta_like
from pretrain.utils.errors import UserError

__all__ = ["HFPlan", "ShardWriter", "meta_like", "plan_hf_tensors", "stream_hf_tensors"]

DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def parse_shard_size(text: str | int) -> int:
    """``"5GB"`` (10^9), ``"500MiB"`` (2^20), ``"100kb"`` or a byte count, as ``save_pretrained`` reads them."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
        if m is None or m.group(2).upper() not in _UNITS:
            raise UserError(f"--max-shard-size {text}: expected a size such as 5GB, 500MB or 2GiB")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value < 1:
        raise UserError(f"--max-shard-size {text}: must be at least 1 byte")
    return value


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
        """``_real_outputs`` of the whole-model mapping for ``real`` (tensors of this group)."""
        made = _real_outputs(self.convert, self.metas, {self.names[n]: t for n, t in real.items()})
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
    wanted: set[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """``(hf_name, tensor)`` for every output of ``convert`` (canonical dict -> HF dict), computed one
    layer group at a time; ``metas``: each canonical tensor's dtype and shape on the ``meta`` device
    (default: ``meta_like(get(name))``, reading every tensor once more). With ``plan``, a group whose
    outputs each come from one canonical tensor is converted one tensor at a time, in the same order
    (memory: one canonical tensor and its outputs, not the layer's), and a group the plan can
    convert alone (:class:`LocalGroup`) is. ``wanted`` (with ``plan``): only these outputs, in the
    same order; a group with none of them is not read."""
    if metas is None:
        metas = {n: meta_like(get(n)) for n in names}
    expected = set(plan.outputs) if plan is not None and plan.outputs else set(convert(dict(metas)))
    seen: set[str] = set()
    if wanted is not None:
        assert plan is not None, "wanted needs the plan"
        expected &= wanted
    for i, group in enumerate(layer_groups(names)):
        if plan is not None and wanted is not None and not any(hf in wanted for hf, _ in plan.groups[i]):
            continue
        local = plan.local[i] if plan is not None and i < len(plan.local) else None
        run = local.run if local is not None else functools.partial(_real_outputs, convert, metas)
        if plan is not None and _one_source_each(plan.groups[i]):
            source: str | None = None
            made: dict[str, torch.Tensor] = {}
            for hf_name, src in plan.groups[i]:
                assert src is not None
                if wanted is not None and hf_name not in wanted:
                    continue
                if src != source:
                    made = {}  # the previous tensor's outputs go before the next is read
                    made, source = run({src: get(src)}), src
                seen.add(hf_name)
                yield hf_name, made.pop(hf_name)
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


def _local_group(group: list[str], metas: dict[str, torch.Tensor], hf_metas: dict[str, torch.Tensor],
                 layer_convert: LayerConvert, fake: Callable[[str], torch.Tensor]) -> LocalGroup | None:  # fmt: skip
    """Layer group ``group`` as the only layer of a one-layer model, or ``None`` when that model's
    mapping does not make the same tensors (names, dtypes, shapes) as the whole model's."""
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
    made = _real_outputs(convert, local, {names[n]: fake(n) for n in group})
    outputs = {k: k if layer is None else _global_name(k, layer) for k in made}
    for k, g in outputs.items():
        if g not in hf_metas or (hf_metas[g].dtype, hf_metas[g].shape) != (made[k].dtype, made[k].shape):
            return None
    if len(set(outputs.values())) != len(outputs):
        return None
    order = {g: j for j, g in enumerate(hf_metas)}
    outputs = dict(sorted(outputs.items(), key=lambda kv: order[kv[1]]))
    return LocalGroup(convert, local, names, outputs)


def plan_hf_tensors(names: Sequence[str], metas: dict[str, torch.Tensor], convert: Convert,
                    layer_convert: LayerConvert | None = None) -> HFPlan | None:  # fmt: skip
    """What :func:`stream_hf_tensors` will yield, in order, from a dry run on fake tensors (shapes
    only: no data read, no memory); ``None`` when the mapping cannot run on them. With
    ``layer_convert`` each layer group is, where it checks out, converted alone (:class:`LocalGroup`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        hf_metas = convert(dict(metas))  # on placeholders alone: cheaper outside the fake mode
        with FakeTensorMode(allow_non_fake_inputs=True):

            def fake(name: str) -> torch.Tensor:
                return torch.empty(metas[name].shape, dtype=metas[name].dtype)

            groups, local, seen = [], [], set()
            for group in layer_groups(names):
                lg = (
                    None
                    if layer_convert is None
                    else _local_group(group, metas, hf_metas, layer_convert, fake)
                )
                run = lg.run if lg is not None else functools.partial(_real_outputs, convert, metas)
                outs = [n for n in run({n: fake(n) for n in group}) if n not in seen]
                seen.update(outs)
                groups.append(_sources(run, group, outs, fake))
                local.append(lg)
    except Exception:  # noqa: BLE001  # e.g. a data-dependent step: write without a plan
        return None
    if seen != set(hf_metas):
        return None
    # the order the stream yields, with the placeholders' dtypes and shapes (a real tensor unlike its
    # placeholder only costs the writer a header rewrite: ShardWriter checks every add)
    tensors = [Planned(n, hf_metas[n].dtype, tuple(hf_metas[n].shape)) for g in groups for n, _ in g]
    return HFPlan(tensors, groups, local, frozenset(hf_metas))


def split_shards(tensors: Sequence[Planned], max_bytes: int) -> list[list[Planned]]:
    """The shards :class:`ShardWriter` fills from ``tensors`` in order: a new one when the next
    tensor would take a non-empty shard over ``max_bytes`` (``save_pretrained``'s rule)."""
    shards: list[list[Planned]] = []
    size = 0
    for t in tensors:
        if not shards or (size and size + t.nbytes > max_bytes):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _header(entries: dict[str, dict[str, object]], metadata: dict[str, str]) -> bytes:
    """A safetensors header: 8-byte length, then JSON padded with spaces to 8-byte aligned data."""
    header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # 8-byte aligned data, as the safetensors writer pads
    return struct.pack("<Q", len(header)) + header


def _entries(tensors: Sequence[Planned]) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    offset = 0
    for t in tensors:
        out[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + t.nbytes]}  # fmt: skip
        offset += t.nbytes
    return out


class ShardWriter:
    """Sharded safetensors in ``directory`` (see the module docstring); ``add`` then ``close``.

    With ``plan`` (every tensor ``add`` will get, in order: :func:`plan_hf_tensors`) each shard's
    header is written first and each tensor's bytes go straight after it: every byte is written
    once. Without a plan, or from the first ``add`` that departs from it, a shard's data is
    written first and the file is finished by writing the header and copying the data after it
    (in the kernel). The files are the same bytes either way."""

    def __init__(
        self, directory: Path, *, max_shard_size: int, metadata: dict[str, str] | None = None,
        plan: Sequence[Planned] | None = None,
    ) -> None:  # fmt: skip
        self.directory = Path(directory)
        self.max_bytes = max_shard_size
        self.metadata = {"format": "pt", **(metadata or {})}
        self.shards: list[tuple[Path, list[str]]] = []  # finished shard files (temporary names)
        self.total = 0
        self._planned = split_shards(plan, max_shard_size) if plan is not None else None
        self._expect: list[Planned] | None = None  # the open shard's plan, while adds follow it
        self._file: BinaryIO | None = None
        self._data_start = 0  # where the open file's tensor data begins
        self._header: dict[str, dict[str, object]] = {}
        self._offset = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu").contiguous()
        if t.dtype not in SAFETENSORS_DTYPES:
            raise UserError(f"to-hf: tensor {name} has dtype {t.dtype}, which safetensors cannot store")
        nbytes = t.numel() * t.element_size()
        if self._file is not None and self._offset and self._offset + nbytes > self.max_bytes:
            self._finish_shard()
        if self._file is None:
            self._open_shard()
        if self._expect is not None:
            i = len(self._header)
            if i >= len(self._expect) or self._expect[i] != Planned(name, t.dtype, tuple(t.shape)):
                self._expect = self._planned = None  # departed from the plan: rewrite this shard's header
        assert self._file is not None
        if nbytes:
            self._file.write(t.reshape(-1).view(torch.uint8).numpy().data)
        self._header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self._offset, self._offset + nbytes]}  # fmt: skip
        self._offset += nbytes
        self.total += nbytes

    def _open_shard(self) -> None:
        i = len(self.shards)
        if self._planned is not None and i < len(self._planned):
            self._expect = self._planned[i]
            self._file = open(self.directory / f".shard{i}.safetensors", "wb")  # noqa: SIM115
            head = _header(_entries(self._expect), self.metadata)
            self._file.write(head)
            self._data_start = len(head)
        else:
            self._expect = self._planned = None
            self._file = open(self.directory / f".shard{i}.data", "wb")  # noqa: SIM115
            self._data_start = 0

    def _finish_shard(self) -> None:
        assert self._file is not None
        written = Path(self._file.name)
        self._file.close()
        self._file = None
        path = self.directory / f".shard{len(self.shards)}.safetensors"
        if self._expect is None or len(self._header) != len(self._expect):  # header still to write
            final = path.with_suffix(".header")
            with open(final, "wb") as out, open(written, "rb") as src:
                out.write(_header(self._header, self.metadata))
                src.seek(self._data_start)
                _copy(src, out, self._offset)
            written.unlink()
            final.rename(path)
        self.shards.append((path, list(self._header)))
        self._header, self._offset, self._expect = {}, 0, None

    def close(self) -> list[Path]:
        """Finish the last shard, give the files their final names, write the index if sharded."""
        if self._file is not None or not self.shards:
            if self._file is None:
                self._open_shard()
            self._finish_shard()
        n = len(self.shards)
        names = shard_file_names(n)
        weight_map = {}
        for (path, tensors), final in zip(self.shards, names, strict=True):
            path.rename(self.directory / final)
            weight_map.update(dict.fromkeys(tensors, final))
        if n > 1:
            write_index(self.directory, weight_map, self.total)
        return [self.directory / f for f in names]


def shard_file_names(n: int) -> list[str]:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` for ``n`` > 1 shards."""
    return (
        ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )


def write_index(directory: Path, weight_map: dict[str, str], total: int) -> None:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it (sorted keys)."""
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_planned_shards(
    directory: Path, shards: Sequence[Sequence[Planned]], owned: Sequence[bool],
    tensors: Iterable[tuple[str, torch.Tensor]], *, metadata: dict[str, str] | None = None,
) -> None:  # fmt: skip
    """The ``owned`` shard files of ``shards`` (:func:`split_shards` of the plan) under their final
    names, from ``tensors`` (exactly the owned shards' tensors, in order): the bytes
    :class:`ShardWriter` writes for the same plan (a process of a split export writes its share)."""
    names = shard_file_names(len(shards))
    head = {"format": "pt", **(metadata or {})}
    expected = iter([(i, t) for i, shard in enumerate(shards) if owned[i] for t in shard])
    fh: BinaryIO | None = None
    current = -1
    try:
        for name, tensor in tensors:
            i, planned = next(expected, (-1, None))
            t = tensor.detach().to("cpu").contiguous()
            if planned is None or planned != Planned(name, t.dtype, tuple(t.shape)):
                raise RuntimeError(
                    f"to-hf: tensor {name} {tuple(t.shape)} departs from the shard plan ({planned})"
                )
            if i != current:
                if fh is not None:
                    fh.close()
                fh = open(directory / names[i], "wb")  # noqa: SIM115
                fh.write(_header(_entries(shards[i]), head))
                current = i
            assert fh is not None
            if t.numel():
                fh.write(t.reshape(-1).view(torch.uint8).numpy().data)
        if next(expected, None) is not None:
            raise RuntimeError("to-hf: fewer tensors than the shard plan")
    finally:
        if fh is not None:
            fh.close()


def _copy(src: BinaryIO, dst: BinaryIO, count: int) -> None:
    """Append ``count`` bytes of ``src`` from its position to ``dst``: in the kernel where possible."""
    dst.flush()
    start = src.tell()
    if hasattr(os, "copy_file_range"):
        try:
            done = 0
            while done < count:
                n = os.copy_file_range(src.fileno(), dst.fileno(), count - done)
                if n == 0:
                    break
                done += n
            if done == count:
                return
            src.seek(start + done)
        except OSError:
            src.seek(start)
    shutil.copyfileobj(src, dst, 1 << 20)
