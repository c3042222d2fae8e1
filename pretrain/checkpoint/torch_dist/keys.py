"""megatron-core ``torch_dist`` keys -> our tensors: which key (and which slice of its leading layer
and expert axes) holds each of our full-model tensors.

Layer tensors are stacked over layers (``decoder.layers.self_attention.linear_qkv.weight [L, ...]``)
or per layer with global indices (``decoder.layers.5....``, megatron-core's ``non_homogeneous_layers``:
``--moe-layer-freq`` mixing dense and MoE layers, ``singleton_local_shards``). Routed experts are one
tensor with an expert axis or one key per expert (:mod:`pretrain.checkpoint.upstream.expert_names`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pretrain.checkpoint.torch_dist.dcp_meta import TensorStorageMetadata
from pretrain.checkpoint.upstream.expert_names import DIST_EXPERTS, DIST_SINGLETON, FC
from pretrain.checkpoint.upstream.names import ENC, to_local_name

_STACKED = re.compile(r"^(.*?\blayers)\.(?!\d)(.*)$")
_PER_LAYER = re.compile(r"^(?:decoder|encoder)\.layers\.(\d+)\.(.*)$")


@dataclass(frozen=True)
class Ref:
    key: str  # the torch_dist key
    index: tuple[int, ...] = ()  # indices into the leading axes (layer and/or expert); () whole
    halves: str | None = None  # singleton SwiGLU experts: the ``_v`` (up) key, concatenated after ``key``

    @property
    def layer(self) -> int | None:
        """The stacked-layer index (None: a whole or per-layer key)."""
        return self.index[0] if self.index else None


def _expert_refs(
    layer: int | None, rest: str, key: str, size: tuple[int, ...]
) -> list[tuple[str, Ref, tuple[int, ...]]] | None:
    """Routed-expert tensors of one torch_dist key (``layer`` None: stacked over layers), as
    ``(our name, where, shape)``: the expert-axis form or ``singleton_local_shards`` per-expert
    keys. None: not an expert key."""
    layers = range(size[0]) if layer is None else [layer]
    base = size[1:] if layer is None else size
    if m := DIST_EXPERTS.match(rest):
        return [
            (f"{ENC}layers.{i}.mlp.experts.{e}.{FC[m.group(1)]}.weight",
             Ref(key, (i, e) if layer is None else (e,)), tuple(base[1:]))
            for i in layers for e in range(base[0])
        ]  # fmt: skip
    if m := DIST_SINGLETON.match(rest):
        name = f"mlp.experts.{m.group(1)}.{FC[m.group(2)]}.weight"
        return [
            (f"{ENC}layers.{i}.{name}", Ref(key, (i,) if layer is None else ()), tuple(base)) for i in layers
        ]
    return None


def _refs_of(key: str, size: tuple[int, ...]) -> list[tuple[str, Ref, tuple[int, ...]]]:
    """``(our name, where, shape)`` of every tensor one torch_dist key holds (none: skipped)."""
    stacked, per_layer = _STACKED.match(key), _PER_LAYER.match(key)
    if stacked is not None:
        moe = _expert_refs(None, stacked.group(2), key, size)
        if moe is not None:
            return moe
        template = to_local_name(f"{stacked.group(1)}.0.{stacked.group(2)}")
        if template is None:
            return []
        return [
            (template.replace(".layers.0.", f".layers.{i}.", 1), Ref(key, (i,)), tuple(size[1:]))
            for i in range(size[0])
        ]
    if per_layer is not None:
        moe = _expert_refs(int(per_layer.group(1)), per_layer.group(2), key, size)
        if moe is not None:
            return moe
    local = to_local_name(key)
    return [] if local is None else [(local, Ref(key), tuple(size))]


def map_keys(meta: dict[str, TensorStorageMetadata]) -> tuple[dict[str, Ref], dict[str, tuple[int, ...]]]:
    """Our full-model local names (global layer indices) -> where they live; and stacked sizes.

    A SwiGLU fc1 saved with ``singleton_local_shards`` is two keys, ``<key>_w`` (gate rows) and
    ``<key>_v`` (up rows), read as one ``[gate; up]`` tensor."""
    refs: dict[str, Ref] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for key, md in meta.items():
        paired = (
            key[:-2]
            if key.endswith(("_w", "_v")) and {key[:-2] + "_w", key[:-2] + "_v"} <= meta.keys()
            else None
        )
        if paired is not None and key.endswith("_v"):
            continue  # read with its _w half
        for name, ref, shape in _refs_of(paired or key, tuple(md.size)):
            if paired is not None:
                ref, shape = Ref(key, ref.index, paired + "_v"), (2 * shape[0], *shape[1:])
            refs[name], shapes[name] = ref, shape
    return refs, shapes
