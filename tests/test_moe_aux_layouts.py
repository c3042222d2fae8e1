"""Issue 27's layouts with the router losses on: TP 2 x EP 2 (ETP 2) and PP 2 x EP 2 training equal
one process running the same microbatches on the loss, the load-balancing (aux) and z losses of
every MoE layer, the tokens each expert received (after capacity dropping), every gradient and the
optimizer steps. (Megatron's aux loss is per microbatch of each DP rank, before dispatch, so the
one-process reference runs the DP ranks' microbatches in turn; tests/test_moe_router_losses.py.)"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch

from pretrain.distributed import DDPConfig
from pretrain.models.moe.layer import MoEMLP
from pretrain.parallel.config import ParallelConfig
from tests.distributed import run_distributed
from tests.dp_training import OPT, global_batches
from tests.test_moe_ep import _check, _pp_worker
from tests.test_moe_parallel import moe_config, moe_weights

MICRO = 2  # per DP rank; DP is 2 in both layouts, so the reference runs 4


def _router_worker(rank: int, world: int, par: ParallelConfig, *args: Any) -> dict[str, Any]:
    """:func:`tests.test_moe_ep._pp_worker`, also returning each MoE layer's :class:`RouterStats`
    summed over the run (keyed by layer number) and this rank's DP and TP coordinates."""
    import pretrain.pipeline.partition as partition

    chunks: list[torch.nn.Module] = []
    build = partition.build_model_chunks

    def keep(*a: Any, **k: Any) -> list[torch.nn.Module]:
        chunks.extend(build(*a, **k))
        return chunks

    with mock.patch.object(partition, "build_model_chunks", keep):
        out = _pp_worker(rank, world, par, *args)
    ps = chunks[0].ps  # type: ignore[attr-defined]
    out["router"] = {
        m.layer_number: (m.stats.load_balancing_loss, m.stats.z_loss, m.stats.tokens_per_expert.clone())
        for c in chunks
        for m in c.modules()
        if isinstance(m, MoEMLP)
    }
    out["coords"] = (ps.dp_rank, ps.tp_rank)
    return out


def _router_totals(results: list[dict[str, Any]]) -> dict[int, tuple[float, float, torch.Tensor]]:
    """Per MoE layer: the losses and token counts summed over the DP ranks (TP ranks hold copies)."""
    totals: dict[int, list[Any]] = {}
    for r in results:
        if r["coords"][1] != 0:
            continue
        for layer, (lb, z, tokens) in r["router"].items():
            t = totals.setdefault(layer, [0.0, 0.0, torch.zeros_like(tokens)])
            t[0], t[1], t[2] = t[0] + lb, t[1] + z, t[2] + tokens
    return {k: (v[0], v[1], v[2]) for k, v in totals.items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "par", [ParallelConfig(tp=2, ep=2), ParallelConfig(pp=2, ep=2)], ids=["tp2_ep2_etp2", "pp2_ep2"]
)
def test_router_losses_under_tp_ep_and_pp_ep_equal_one_process(par: ParallelConfig) -> None:
    cfg = moe_config(
        num_layers=4, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, moe_expert_capacity_factor=1.0
    )
    weights, batches = moe_weights(cfg), global_batches(cfg, steps=2)
    args = (cfg, weights, batches, DDPConfig(), OPT)
    (one,) = run_distributed(_router_worker, 1, ParallelConfig(), *args, 2 * MICRO)
    got = run_distributed(_router_worker, 4, par, *args, MICRO)
    lasts = [r["losses"] for r in got if r["losses"] is not None]  # PP: the last stage's
    assert len(lasts) == 4 // par.pp
    for r in got:
        r["losses"] = r["losses"] if r["losses"] is not None else lasts[0]
    _check(got, one, grads=True)  # loss, grad norms, every gradient and parameter after the steps
    want, have = _router_totals([one]), _router_totals(got)
    assert set(have) == set(want) == {0, 2, 3}  # layer 1 is dense
    for layer, (lb, z, tokens) in want.items():
        assert lb > 0 and z > 0
        assert have[layer][0] == pytest.approx(lb, rel=1e-5), layer
        assert have[layer][1] == pytest.approx(z, rel=1e-5), layer
        assert torch.equal(have[layer][2], tokens), layer
