"""Reshard the optimizer state of our checkpoints along with the model.

Each source rank file's ``optimizer`` entry is :meth:`MixedPrecisionOptimizer.state_dict` form:
``{"params": {"model{c}.{local name}": {"param", "exp_avg", "exp_avg_sq"}}, "step",
"param_groups", "grad_scaler"}``; distributed-optimizer runs instead keep every DP rank's shard in
``distrib_optim.pt`` beside it, which is reassembled into that form with
:func:`pretrain.optim.distrib_optimizer.reassemble_full_state` (lazily, a few files at a time).
Every state tensor is shaped like its parameter, so it is gathered and re-split exactly like the
parameter (same split dim, vocab rows padded with zeros). The output is always the full
(non-distributed) form, because the target data-parallel size is unknown at reshard time: training
loads it into either optimizer (:meth:`DistributedOptimizer.load_full_state_dict` takes its own
element ranges).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint.expert_layout import expert_index, renumber_expert
from pretrain.checkpoint.legacy.layout import DISTRIB_OPTIM_FILE
from pretrain.checkpoint.legacy.reader import LegacyReader
from pretrain.checkpoint.legacy.writer import _shard
from pretrain.checkpoint.optimizer.state import (
    OPTIM_STATES,
    OptimizerCommon,
    OptimizerSource,
    from_mcore_scheduler,
)
from pretrain.checkpoint.plan import ModelSpec, Slot
from pretrain.checkpoint.safe_unpickle import load_untrusted
from pretrain.checkpoint.types import CheckpointReader
from pretrain.checkpoint.upstream.args_semantics import untie_head_names
from pretrain.checkpoint.upstream.names import to_local_name
from pretrain.checkpoint.upstream.optimizer import UpstreamParam, upstream_full_state
from pretrain.model_options import is_mcore
from pretrain.optim.distrib_optimizer import reassemble_full_state
from pretrain.parallel.config import ParallelConfig
from pretrain.tensor_parallel.vocab import padded_vocab_size
from pretrain.utils.errors import UserError


def _chunk_index(chunk_key: str) -> int:
    return 0 if chunk_key == "model" else int(chunk_key[5:])


def _optim_key(spec: ModelSpec, chunk: str, file_key: str) -> str:
    """Our optimizer-state key (``model{c}.{local name}``) of model tensor ``file_key``."""
    local = to_local_name(file_key) or file_key  # the model file may use megatron-core names
    if spec.cfg.untie_embeddings_and_output_weights:  # mcore output_layer: our untied head
        local = next(iter(untie_head_names({local: file_key})))
    return f"model{_chunk_index(chunk)}.{local}"


def _upstream_params(reader: LegacyReader, i: int) -> list[UpstreamParam]:
    """File ``i``'s parameters in ``named_parameters`` order (its model dicts' order)."""
    chunks = sorted(reader.flats[i], key=_chunk_index)
    return [
        UpstreamParam(_optim_key(reader.spec, chunk, key), key, t)
        for chunk in chunks
        for key, t in reader.flats[i][chunk].items()
        if not key.endswith("_extra_state")
    ]


class _FullStates:
    """The full-form optimizer ``params`` of each source rank file, reassembled on demand from
    ``distrib_optim.pt`` (ours) or named from an upstream megatron-core file's torch state, and
    kept for the ``capacity`` most recently used files only."""

    def __init__(self, reader: LegacyReader, capacity: int) -> None:
        self.reader, self.files, self.states = reader, reader.files, reader.states
        self.capacity = max(capacity, 1)
        self.cache: OrderedDict[int, dict[str, Any]] = OrderedDict()

    def distrib_path(self, i: int) -> Path | None:
        """Rank file ``i``'s ``distrib_optim.pt``, if any: in the directory of its DP rank 0, whose
        EP rank is not always 0 (with ETP below TP, TP rank t's DP rank 0 has EP rank t // ETP)."""
        here = self.files[i].parent
        dirs = (
            [here]
            if self.reader.info.ep == 1
            else sorted(here.parent.glob(f"{here.name[:-3]}[0-9][0-9][0-9]"))
        )
        return next((d / DISTRIB_OPTIM_FILE for d in dirs if (d / DISTRIB_OPTIM_FILE).exists()), None)

    def distributed(self, i: int) -> bool:
        return self.distrib_path(i) is not None

    def _convert(self, i: int) -> dict[str, Any]:
        path = self.distrib_path(i)
        if path is not None:
            if not self.reader.info.ours:
                raise UserError(
                    f"{path}: distributed-optimizer buffers bound to "
                    "the saving layout are not read; save with --ckpt-format torch_dist and "
                    "--dist-ckpt-optim-fully-reshardable"
                )
            return self._reassemble(path, self.reader.info.ep, self._expert_siblings(i))
        state = self.states[i].get("optimizer")
        if not state:
            raise UserError(f"--with-optimizer: {self.files[i]} holds no optimizer state")
        if self.reader.info.ours:
            return state
        return upstream_full_state(state, _upstream_params(self.reader, i), source=str(self.files[i]))

    def full(self, i: int) -> dict[str, Any]:
        """File ``i``'s optimizer state in the full form (raises a one-line error if none)."""
        if self.reader.info.ours and not self.distributed(i):
            state = self.states[i].get("optimizer")
            if not isinstance(state, dict) or "params" not in state:
                raise UserError(f"--with-optimizer: {self.files[i]} holds no optimizer state")
            return state
        if i not in self.cache:
            self.cache[i] = self._convert(i)
            while len(self.cache) > self.capacity:
                self.cache.popitem(last=False)
        self.cache.move_to_end(i)
        return self.cache[i]

    def _expert_siblings(self, i: int) -> list[Path]:
        """The other ``distrib_optim.pt`` files of rank file ``i``'s stage whose experts are the same
        expert-TP shard (TP ranks t' = t mod ETP, ETP below TP): its expert-DP group spans them."""
        tp = self.reader.info.tp
        etp = (
            int(self.reader.args.get("expert_tensor_parallel_size") or tp)
            if self.reader.spec.cfg.num_experts
            else tp
        )
        p, t = divmod(i, tp)
        paths = [self.distrib_path(p * tp + u) for u in range(tp) if u != t and u % etp == t % etp]
        return [x for x in paths if x is not None]

    @staticmethod
    def _shards(path: Path) -> list[dict[str, Any]]:
        shards = load_untrusted(path).get("shards")
        if not isinstance(shards, list) or not shards:
            raise UserError(f"{path}: no distributed-optimizer shards ('shards' entry)")
        return shards

    def _reassemble(self, path: Path, ep: int, siblings: list[Path]) -> dict[str, Any]:
        """The full form of one (TP, PP) rank's ``distrib_optim.pt``: the dense state from every DP
        rank, and with expert parallelism every EP rank's experts (each sharded over its own
        expert-DP group, which with ETP below TP spans the ``siblings`` too) under global expert
        indices, as the merged model files name them."""
        shards = self._shards(path)
        experts = [s for f in [path, *siblings] for s in (shards if f == path else self._shards(f))]
        try:
            if ep == 1:
                return reassemble_full_state(shards, ep_rank=0, expert_shards=experts)
            per = int(self.reader.spec.cfg.num_experts or 0) // ep
            full = reassemble_full_state(shards, ep_rank=0, expert_shards=experts)
            for e in range(1, ep):
                theirs = reassemble_full_state(shards, ep_rank=e, expert_shards=experts)["params"]
                full["params"].update(
                    (renumber_expert(k, e * per), v) for k, v in theirs.items() if expert_index(k) is not None
                )
            return full
        except (ValueError, KeyError, IndexError, TypeError, RuntimeError) as exc:
            raise UserError(f"{path}: cannot reassemble the optimizer shards ({exc})") from None


@dataclasses.dataclass
class _OptimizerView(LegacyReader):
    """The reader, but its tensors are one optimizer state (``param``, ``exp_avg``, ...)."""

    state_kind: str = "param"
    full_states: _FullStates | None = None

    def _part(self, ref: tuple[int, str, str]) -> torch.Tensor:
        i, chunk, file_key = ref
        key = _optim_key(self.spec, chunk, file_key)
        assert self.full_states is not None
        params = self.full_states.full(i)["params"]
        where = self.full_states.distrib_path(i) or self.files[i]
        if key not in params:
            raise UserError(f"{where}: optimizer state has no entry {key!r}")
        shape = self.flats[i][chunk][file_key].shape
        if params[key][self.state_kind].numel() != shape.numel():
            got = tuple(params[key][self.state_kind].shape)
            raise UserError(
                f"{where}: optimizer state {key} {self.state_kind} has shape {got}, expected {shape}"
            )
        return params[key][self.state_kind].view(shape)


@dataclasses.dataclass
class LegacyOptimizerSource:
    """The optimizer state of our per-rank files as canonical full fp32 tensors
    (an :class:`~pretrain.checkpoint.optimizer.state.OptimizerSource`)."""

    views: dict[str, _OptimizerView]
    common: OptimizerCommon
    scheduler: dict[str, Any] | None
    global_batch_size: int | None

    def state(self, kind: str, canonical: str) -> torch.Tensor:
        return self.views[kind].tensor(canonical).float()

    def state_stored_rows(self, kind: str, canonical: str) -> torch.Tensor:
        return self.views[kind].stored_rows(canonical).float()


def open_legacy_optimizer(reader: CheckpointReader) -> LegacyOptimizerSource:
    """The optimizer state of our checkpoint ``reader`` (one line and exit 2 when it has none)."""
    if not isinstance(reader, LegacyReader):
        raise UserError("--with-optimizer: this checkpoint format carries no optimizer state we read")
    if not reader.info.ours and not is_mcore(reader.args):
        raise UserError(
            "--with-optimizer: the optimizer state of legacy-model Megatron-LM files (keyed by parameter "
            "position in that version's order) is not read; save with --ckpt-format torch_dist"
        )
    full_states = _FullStates(reader, capacity=2 * reader.info.tp)
    first = full_states.full(0)
    views = {
        kind: _OptimizerView(
            **{f.name: getattr(reader, f.name) for f in dataclasses.fields(reader)},
            state_kind=kind,
            full_states=full_states,
        )
        for kind in OPTIM_STATES
    }
    for view in views.values():
        view.head_copies = {}  # the head copy's state is checked through the model tensors
    common = OptimizerCommon(
        step=int(first.get("step") or 0),
        param_groups=tuple(first.get("param_groups") or ()),
        grad_scaler=first.get("grad_scaler"),
    )
    scheduler = reader.states[0].get("opt_param_scheduler")
    meta = reader.metadata
    if meta is not None:
        gbs = meta.provenance.global_batch_size
    else:  # Megatron-LM's OptimizerParamScheduler state, counting samples
        gbs = reader.args.get("global_batch_size")
        scheduler = from_mcore_scheduler(scheduler, global_batch_size=gbs)
    return LegacyOptimizerSource(views, common, scheduler if isinstance(scheduler, dict) else None, gbs)


def _state_rows(opt: OptimizerSource, kind: str, slot: Slot, padded: int) -> torch.Tensor:
    """State ``kind`` of ``slot``'s tensor; a vocabulary tensor's with its stored padding rows
    (as many as fit in ``padded``, as :func:`pretrain.checkpoint.legacy.writer.vocab_rows`)."""
    return (
        opt.state_stored_rows(kind, slot.canonical)[:padded]
        if slot.vocab
        else opt.state(kind, slot.canonical)
    )


def optimizer_writer(
    opt: OptimizerSource, spec: ModelSpec, target: ParallelConfig
) -> Callable[[int, int, list[list[Slot]]], dict[str, Any] | None]:
    """The ``optimizer`` callback of :func:`pretrain.checkpoint.legacy.writer.write_layout`: each target
    rank file's full-form ``optimizer`` entry, every state split exactly like its parameter."""
    cfg = spec.cfg
    padded = padded_vocab_size(cfg.vocab_size, tp=target.tp, divisible_by=cfg.make_vocab_size_divisible_by)
    common = opt.common.as_ours()

    def build(tp_rank: int, pp_rank: int, slots: list[list[Slot]]) -> dict[str, Any]:
        params: dict[str, dict[str, torch.Tensor]] = {}
        for c, chunk_slots in enumerate(slots):
            for slot in chunk_slots:
                params[f"model{c}.{slot.local}"] = {
                    kind: _shard(
                        _state_rows(opt, kind, slot, padded),
                        slot,
                        tp_rank=tp_rank,
                        tp=target.tp,
                        padded=padded,
                    )  # fmt: skip
                    for kind in OPTIM_STATES
                }
        return {"params": params, **common}

    return build


def open_optimizer_source(reader: CheckpointReader) -> OptimizerSource:
    """The optimizer state of an opened checkpoint (our per-rank files or ``torch_dist``)."""
    from pretrain.checkpoint.torch_dist.reader import TorchDistReader

    if isinstance(reader, TorchDistReader):
        from pretrain.checkpoint.torch_dist.optimizer import open_optimizer

        return open_optimizer(reader)
    return open_legacy_optimizer(reader)


def describe_optimizer(reader: CheckpointReader) -> dict[str, Any]:
    """What ``mlm-convert inspect`` says of a checkpoint's optimizer state: ``{"present",
    "reshardable", "step", "why"}`` (``why``: the one-line reason it cannot be carried)."""
    try:
        opt = open_optimizer_source(reader)
    except UserError as exc:
        why = str(exc).removeprefix("--with-optimizer: ")
        return {
            "present": "holds no optimizer state" not in why,
            "reshardable": False,
            "step": None,
            "why": why,
        }
    return {"present": True, "reshardable": True, "step": opt.common.step, "why": None}
