"""The reference for our ``torch_dist`` writer: the same save plan through dcp's own ``dcp.save``.

:func:`dcp_save` hands the plan :func:`pretrain.checkpoint.torch_dist.writer.write_torch_dist`
makes (its items, in its order, with the same data) to ``torch.distributed.checkpoint.save`` with
dcp's ``DefaultSavePlanner`` and ``FileSystemWriter(thread_count=N)``: what megatron-core's
``dist_checkpointing.save`` runs. Our files must equal what this writes, byte for byte.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from pretrain.checkpoint.optimizer.state import OptimizerSource
from pretrain.checkpoint.torch_dist import writer
from pretrain.checkpoint.types import TensorSource
from pretrain.checkpoint.work_split import SINGLE
from pretrain.parallel.config import ParallelConfig


class ReferencePlanner(DefaultSavePlanner):
    """dcp's planner over our plan's items (``WriteItem`` per chunk, one ``TensorProperties`` per
    key as a planner builds them), each item's data from our ``_ChunkMaker.data``."""

    def __init__(self, items: list[writer._Item], make: writer._ChunkMaker) -> None:
        super().__init__()
        self.items, self.make = items, make
        self.by_index: dict[MetadataIndex, writer._Item] = {}

    def create_local_plan(self) -> SavePlan:
        planned: list[WriteItem] = []
        props: dict[str, TensorProperties] = {}
        for item in self.items:
            chunk = item.chunk
            if chunk is None:
                index = MetadataIndex(item.key)
                planned.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
            else:
                index = MetadataIndex(item.key, torch.Size(chunk.offsets))
                data = TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)
                    ),
                    properties=props.setdefault(item.key, TensorProperties(dtype=chunk.dtype)),
                    size=torch.Size(chunk.size),
                )
                planned.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
            self.by_index[index] = item
        self.plan = SavePlan(planned, planner_data={})
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = self.make.data(self.by_index[write_item.index])
        return io.BytesIO(data) if isinstance(data, bytes) else data


def dcp_save(
    source: TensorSource, it_dir: Path, target: ParallelConfig, *, thread_count: int,
    optimizer: OptimizerSource | None = None, distributed_optimizer: bool = False,
) -> None:  # fmt: skip
    """``dcp.save`` of the plan ``write_torch_dist(source, ..., target, optimizer=...)`` writes,
    into ``it_dir`` (one process)."""
    entries = writer._entries(source, target.tp)
    if optimizer is not None:
        dtype = source.spec.cfg.params_dtype
        entries += writer._optimizer_entries(entries, dtype, distributed=distributed_optimizer)
    items = writer._plans(entries, SINGLE)[0]
    make = writer._ChunkMaker(writer._fetcher(source, optimizer))
    it_dir.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # "assuming ... a single process": intended
        warnings.simplefilter("ignore", UserWarning)
        fs_writer = dcp.FileSystemWriter(str(it_dir), thread_count=thread_count)
        dcp.save({}, storage_writer=fs_writer, planner=ReferencePlanner(items, make), no_dist=True)
