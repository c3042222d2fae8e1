"""Values derived from command-line flags in one place, shared by every command.

:func:`virtual_pipeline_size` turns Megatron's ``--num-layers-per-virtual-pipeline-stage`` into
the number of virtual chunks per pipeline stage, refusing layer counts that do not divide (the
same rule for ``mlm-pretrain`` and ``mlm-finetune``; rounding down would silently change the
schedule and the layer split).
"""

from __future__ import annotations

from pretrain.utils.errors import UserError


def virtual_pipeline_size(num_layers: int, pp: int, layers_per_virtual_stage: int | None) -> int:
    """Virtual chunks per stage: ``num_layers / (pp * n)``; 1 when ``n`` is ``None``."""
    n = layers_per_virtual_stage
    if n is None:
        return 1
    if n <= 0 or num_layers % (pp * n):
        raise UserError(
            f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
            f"--num-layers-per-virtual-pipeline-stage {n}"
        )
    return num_layers // (pp * n)
