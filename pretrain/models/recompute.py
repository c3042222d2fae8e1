"""Which layers of a pipeline stage run under activation checkpointing (Megatron's full
recomputation, ``--recompute-granularity full --recompute-method uniform|block``).

Selective recomputation (the core attention only) is inside the attention module; this module
plans only whole-layer checkpoints.
"""

from __future__ import annotations

from pretrain.config import ModelConfig

LayerGroup = tuple[range, bool]  # local layer indices, checkpointed as one region or not


def layer_groups(cfg: ModelConfig, count: int) -> list[LayerGroup]:
    """The ``count`` local layers as consecutive groups, each run under one checkpoint or plainly.

    * ``recompute_activations`` (this repo's older flag): every layer its own checkpoint;
    * ``uniform``: groups of ``recompute_num_layers`` layers (the last may be shorter), each group
      one checkpoint whose input is the only activation kept;
    * ``block``: the first ``recompute_num_layers`` layers each checkpointed, the rest not;
    * otherwise (no or selective recomputation): one plain group.
    """
    if cfg.recompute_activations:
        return [(range(i, i + 1), True) for i in range(count)]
    n = cfg.recompute_num_layers or 1
    if cfg.recompute_granularity == "full" and cfg.recompute_method == "uniform":
        return [(range(i, min(i + n, count)), True) for i in range(0, count, n)]
    if cfg.recompute_granularity == "full" and cfg.recompute_method == "block":
        kept = min(n, count)
        plain = [(range(kept, count), False)] if kept < count else []
        return [(range(i, i + 1), True) for i in range(kept)] + plain
    return [(range(count), False)] if count else []
