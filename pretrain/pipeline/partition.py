"""Which global layers each pipeline stage (and virtual chunk) holds.

Even split: stage ``s`` holds ``L/p`` consecutive layers. Virtual pipeline (V chunks per stage,
Megatron's interleaved assignment): chunk ``c`` on stage ``s`` holds ``L/(p V)`` layers starting
at ``c * L/V + s * L/(p V)``; e.g. 8 layers, p=2, V=2: stage 0 holds [0,1] and [4,5], stage 1
holds [2,3] and [6,7]. Checkpoints use layer indices local to the stage or chunk; see
:func:`local_to_global`.
"""

from __future__ import annotations

from collections.abc import Callable

from pretrain.config import ModelConfig
from pretrain.models.base import ShardedModule
from pretrain.parallel.state import ParallelState
from pretrain.utils.errors import UserError

StageLayers = list[list[list[int]]]  # [stage][chunk] -> global layer numbers


def _uneven_counts(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    fixed = {0: first, pp - 1: last} if pp > 1 else {0: first if first is not None else last}
    rest_layers = num_layers - sum(v for v in fixed.values() if v is not None)
    rest_stages = [s for s in range(pp) if fixed.get(s) is None]
    if rest_layers < 0 or (rest_stages and rest_layers % len(rest_stages)):
        raise UserError(
            f"cannot split {num_layers} layers over {pp} stages with first={first}, last={last}: "
            f"the remaining {rest_layers} layers must divide evenly over {len(rest_stages)} stages"
        )
    if not rest_stages and rest_layers:
        raise UserError(f"first={first} + last={last} layers do not add up to num_layers={num_layers}")
    per = rest_layers // len(rest_stages) if rest_stages else 0
    counts = [fixed[s] if fixed.get(s) is not None else per for s in range(pp)]
    if any(c is None or c < 0 for c in counts):
        raise UserError(f"invalid layer counts per stage {counts}")
    return [int(c) for c in counts]  # type: ignore[arg-type]


def stage_layer_numbers(
    num_layers: int, *, pp: int, vp: int = 1, first: int | None = None, last: int | None = None
) -> StageLayers:
    """Global layer numbers for every ``[stage][chunk]``."""
    if vp > 1:
        if first is not None or last is not None:
            raise UserError("uneven first/last stage layer counts cannot be combined with --vp > 1")
        if num_layers % (pp * vp):
            raise UserError(f"num_layers {num_layers} is not divisible by --pp {pp} x --vp {vp} = {pp * vp}")
        per = num_layers // (pp * vp)
        return [
            [
                list(range(c * num_layers // vp + s * per, c * num_layers // vp + (s + 1) * per))
                for c in range(vp)
            ]
            for s in range(pp)
        ]
    if first is None and last is None:
        if num_layers % pp:
            raise UserError(f"num_layers {num_layers} is not divisible by --pp {pp}")
        counts = [num_layers // pp] * pp
    else:
        counts = _uneven_counts(num_layers, pp, first, last)
    starts = [sum(counts[:s]) for s in range(pp)]
    return [[list(range(starts[s], starts[s] + counts[s]))] for s in range(pp)]


def local_to_global(local_layer: int, *, stage: int, chunk: int, layers: StageLayers) -> int:
    """Global layer number of ``layers.{local_layer}`` in ``model{chunk}`` of stage ``stage``."""
    return layers[stage][chunk][local_layer]


def build_model_chunks(
    cfg: ModelConfig,
    ps: ParallelState,
    model_cls: Callable[..., ShardedModule] | None = None,
    *,
    first: int | None = None,
    last: int | None = None,
) -> list[ShardedModule]:
    """This rank's V model chunks (``model0 .. modelV-1``), each holding its global layers."""
    if model_cls is None:
        from pretrain.models.gpt import GPTModel

        model_cls = GPTModel
    layers = stage_layer_numbers(cfg.num_layers, pp=ps.pp_size, vp=ps.vp_size, first=first, last=last)
    chunks = []
    for c, numbers in enumerate(layers[ps.pp_rank]):
        pre = ps.is_first_stage and c == 0
        post = ps.is_last_stage and c == ps.vp_size - 1
        chunks.append(model_cls(cfg, ps, pre_process=pre, post_process=post, layer_numbers=numbers))
    return chunks
