"""Global gradient norm: every parallel layout gives the single-process norm (L2 and inf)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pretrain.distributed import DDPConfig
from pretrain.optim.clip_grads import clip_grads_by_norm, counts_for_norm
from pretrain.parallel.layout import compute_layout
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.layers import mark_partition
from tests.distributed import run_distributed
from tests.dp_training import HAS_PIPELINE, OPT, global_batches, worker_pipeline, worker_pp1
from tests.gpt_fixtures import full_weights, single_process_reference, tiny_config


def _reference_norms(cfg, data) -> dict[float, float]:
    _, _, grads = single_process_reference(cfg, full_weights(cfg), data)
    flat = torch.cat([g.flatten().double() for g in grads.values()])
    return {2.0: float(flat.norm()), math.inf: float(flat.abs().max())}


def test_counts_for_norm_skips_tp_duplicates_and_head_copy() -> None:
    layout = compute_layout(world_size=4, tp=2, pp=2)
    replicated = mark_partition(torch.nn.Parameter(torch.zeros(3)), None)
    split = mark_partition(torch.nn.Parameter(torch.zeros(3)), 0)
    layernorm = torch.nn.Parameter(torch.zeros(3))  # no attribute: replicated
    for rank in range(4):
        ps = ParallelState(layout=layout, rank=rank)
        first_tp = ps.tp_rank == 0
        assert counts_for_norm("x.bias", replicated, ps) == first_tp
        assert counts_for_norm("ln.weight", layernorm, ps) == first_tp
        assert counts_for_norm("x.weight", split, ps)
        assert not counts_for_norm("word_embeddings_for_head.weight", split, ps)
    single = ParallelState.single()
    assert counts_for_norm("word_embeddings_for_head.weight", split, single)


def test_clip_coefficient() -> None:
    grads = [torch.full((4,), 3.0), torch.full((2,), 4.0)]
    assert not clip_grads_by_norm(grads, max_norm=100.0, total_norm=10.0)
    assert clip_grads_by_norm(grads, max_norm=1.0, total_norm=10.0)
    torch.testing.assert_close(grads[0], torch.full((4,), 3.0 / (10.0 + 1e-6)))


# (world, tp, distributed optimizer)
LAYOUTS = [(2, 2, False), (4, 2, True), (4, 1, False), (4, 1, True)]


@pytest.mark.slow
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("world,tp,distributed", LAYOUTS)
def test_grad_norm_equals_single_process(world: int, tp: int, distributed: bool, norm_type: float) -> None:
    cfg = tiny_config()
    (data,) = global_batches(cfg, steps=1)
    ref = _reference_norms(cfg, data)[norm_type]
    opt_cfg = dataclasses.replace(OPT, use_distributed_optimizer=distributed, clip_norm_type=norm_type)
    ddp_cfg = DDPConfig(use_distributed_optimizer=distributed)
    for r in run_distributed(worker_pp1, world, tp, cfg, full_weights(cfg), [data], ddp_cfg, opt_cfg, 2):
        ((ok, norm),) = r["steps"]
        assert ok and norm == pytest.approx(ref, rel=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_PIPELINE, reason="pretrain.pipeline (pipeline parallelism) is not there yet")
@pytest.mark.parametrize("distributed", [False, True])
def test_grad_norm_with_pipeline_counts_tied_embedding_once(distributed: bool) -> None:
    cfg = tiny_config()
    (data,) = global_batches(cfg, steps=1)
    ref = _reference_norms(cfg, data)[2.0]
    opt_cfg = dataclasses.replace(OPT, use_distributed_optimizer=distributed)
    ddp_cfg = DDPConfig(use_distributed_optimizer=distributed)
    for r in run_distributed(worker_pipeline, 8, 2, 2, cfg, full_weights(cfg), [data], ddp_cfg, opt_cfg, 2):
        ((ok, norm),) = r["steps"]
        assert ok and norm == pytest.approx(ref, rel=1e-5)
