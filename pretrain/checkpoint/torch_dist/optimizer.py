"""Optimizer state in ``torch_dist`` checkpoints: read it as canonical tensors, and write it.

Reading (:class:`TorchDistOptimizerSource`): each state tensor lives at
``optimizer.state.<name>.<model key>`` with the model tensor's global shape, so it is found
through the same key table as the weight (:attr:`TorchDistReader.refs`) and read one layer region
at a time like the weight. The fp32 main parameter is ``fp32_param`` (mixed precision) or
``param`` (distributed optimizer, ``fully_reshardable``); fp32 runs of the non-distributed
optimizer store none, and the weight itself is the main parameter. Norm weights stored
zero-centred (``apply_layernorm_1p``) get 1 added to the main parameter, never to the moments.

Writing (:func:`optimizer_entries`, :func:`optimizer_common`): for every weight entry of the
``torch_dist`` writer, fp32 entries for ``exp_avg`` / ``exp_avg_sq`` (and ``fp32_param`` when the
weights are fp16/bf16, as ``Float16OptimizerWithFloat16Params`` saves), chunked like the weight;
``common.pt`` gets the ``optimizer`` and ``opt_param_scheduler`` entries megatron-core's optimizer
and ``OptimizerParamScheduler`` load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pretrain.checkpoint.metadata import as_mapping
from pretrain.checkpoint.optimizer.state import (
    OptimizerCommon,
    OptimizerSource,
    from_mcore_common,
    from_mcore_scheduler,
    mcore_state_keys,
    to_mcore_common,
    to_mcore_distributed_common,
    to_mcore_scheduler,
)
from pretrain.checkpoint.torch_dist.reader import TorchDistReader, read_common, read_region
from pretrain.checkpoint.upstream.args_semantics import is_zero_centred_norm
from pretrain.models.sharding import is_vocab_tensor
from pretrain.utils.errors import UserError


@dataclass
class TorchDistOptimizerSource:
    """The optimizer state of a ``torch_dist`` checkpoint as canonical full fp32 tensors."""

    reader: TorchDistReader
    common: OptimizerCommon
    scheduler: dict[str, Any] | None
    global_batch_size: int | None

    def _key(self, kind: str, model_key: str) -> str | None:
        return next((k for k in mcore_state_keys(kind, model_key) if k in self.reader.meta), None)

    def state(self, kind: str, canonical: str) -> torch.Tensor:
        full = self._full_state(kind, canonical)
        return full[: self.reader.spec.cfg.vocab_size] if is_vocab_tensor(canonical) else full

    def state_stored_rows(self, kind: str, canonical: str) -> torch.Tensor:
        return self._full_state(kind, canonical)

    def _full_state(self, kind: str, canonical: str) -> torch.Tensor:
        """State ``kind`` of ``canonical`` with every stored row (vocabulary padding included)."""
        r = self.reader
        if canonical not in r.refs:
            raise UserError(f"{r.path}: no tensor {canonical!r}")
        ref = r.refs[canonical]
        key = self._key(kind, ref.key)
        if key is None:
            if kind == "param" and r.meta[ref.key].properties.dtype == torch.float32:
                return r.stored_rows(canonical).float()  # fp32 weights are the main parameters
            raise UserError(f"{r.path}: optimizer state has no {mcore_state_keys(kind, ref.key)[0]}")
        if tuple(r.meta[key].size) != tuple(r.meta[ref.key].size):
            raise UserError(
                f"{r.path}: {key} has shape {tuple(r.meta[key].size)}, its parameter "
                f"{tuple(r.meta[ref.key].size)} (a flattened distributed-optimizer layout is not read)"
            )
        full = read_region(r.path, r.meta[key], key, ref.index, r.storage).float()
        if kind == "param" and r.norm_1p and is_zero_centred_norm(canonical):
            full = full + 1
        return full


def open_optimizer(reader: TorchDistReader) -> TorchDistOptimizerSource:
    """The optimizer state of ``reader``'s checkpoint (one line and exit 2 when it has none)."""
    common_pt = reader.path / "common.pt"
    common = reader.common or read_common(reader.path, reader.storage)
    if not any(k.startswith("optimizer.state.") for k in reader.meta):
        raise UserError(f"--with-optimizer: {reader.path} holds no optimizer state")
    args = dict(as_mapping(common.get("args")))
    gbs = args.get("global_batch_size")
    if reader.metadata is not None and reader.metadata.provenance.global_batch_size:
        gbs = reader.metadata.provenance.global_batch_size
    return TorchDistOptimizerSource(
        reader=reader,
        common=from_mcore_common(common.get("optimizer"), source=str(common_pt)),
        scheduler=from_mcore_scheduler(common.get("opt_param_scheduler"), global_batch_size=gbs),
        global_batch_size=int(gbs) if gbs else None,
    )


def optimizer_entry_kinds(params_dtype: str, *, distributed: bool = False) -> tuple[tuple[str, str], ...]:
    """``(our kind, megatron-core name)`` of the state tensors written for weights of that dtype
    (the distributed optimizer always keeps fp32 main params, named ``param``)."""
    kinds = (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))
    if distributed:
        return (("param", "param"), *kinds)
    return kinds if params_dtype == "float32" else (*kinds, ("param", "fp32_param"))


def optimizer_common(opt: OptimizerSource, *, params_dtype: str, distributed: bool = False) -> dict[str, Any]:
    """The ``optimizer`` and ``opt_param_scheduler`` entries of ``common.pt`` (and, for the
    distributed optimizer's form, the ``content_metadata`` Megatron-LM builds its load from)."""
    sched = opt.scheduler or {}
    groups = opt.common.param_groups
    wd = max((float(g.get("weight_decay", 0.0)) for g in groups), default=0.0)
    min_lr = float(sched.get("min_lr", 0.0))
    extra: dict[str, Any] = {}
    if distributed:
        entry = to_mcore_distributed_common(opt.common, min_lr=min_lr)
        extra["content_metadata"] = {"distrib_optim_sharding_type": "fully_reshardable"}
    else:
        entry = to_mcore_common(opt.common, mixed_precision=params_dtype != "float32", min_lr=min_lr)
    return {
        **extra,
        "optimizer": entry,
        "opt_param_scheduler": to_mcore_scheduler(
            opt.scheduler, global_batch_size=opt.global_batch_size, weight_decay=wd
        ),  # fmt: skip
    }
