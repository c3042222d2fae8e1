"""Data parallelism: contiguous gradient buffers, bucketed SUM all-reduce / reduce-scatter."""

from pretrain.distributed.ddp import (
    DDPConfig,
    DistributedDataParallel,
    finalize_model_grads,
    global_loss_tokens,
)
from pretrain.distributed.grad_buffer import Bucket, GradBuffer, Range

__all__ = [
    "Bucket",
    "DDPConfig",
    "DistributedDataParallel",
    "GradBuffer",
    "Range",
    "finalize_model_grads",
    "global_loss_tokens",
]
