"""Optimizer stack: mixed precision, loss scaling, clipping, AdamW, ZeRO-1 and the LR schedule."""

from pretrain.distributed.ddp import DistributedDataParallel
from pretrain.optim.config import LRScheduleConfig, OptimizerConfig
from pretrain.optim.distrib_optimizer import DistributedOptimizer, reassemble_full_state
from pretrain.optim.loss_scaler import ConstantLossScaler, DynamicLossScaler, LossScaler, build_loss_scaler
from pretrain.optim.lr_schedule import LRScheduler, lr_at
from pretrain.optim.optimizer import MixedPrecisionOptimizer
from pretrain.parallel.state import ParallelState


def build_optimizer(
    config: OptimizerConfig, ddps: list[DistributedDataParallel], ps: ParallelState
) -> MixedPrecisionOptimizer:
    """The distributed (ZeRO-1) or plain mixed-precision optimizer, as ``config`` says."""
    cls = DistributedOptimizer if config.use_distributed_optimizer else MixedPrecisionOptimizer
    return cls(config, ddps, ps)


__all__ = [
    "ConstantLossScaler",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "LRScheduleConfig",
    "LRScheduler",
    "LossScaler",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "build_loss_scaler",
    "build_optimizer",
    "lr_at",
    "reassemble_full_state",
]
