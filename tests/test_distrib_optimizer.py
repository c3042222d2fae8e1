"""ZeRO-1: shard ranges, per-rank state sizes, reassembled state and per-shard save/load."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.distributed import DDPConfig, GradBuffer, Range
from pretrain.models.sharding import gather_full_state_dict
from pretrain.optim.distrib_optimizer import buffer_shard_ranges, reassemble_full_state
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from tests.distributed import run_distributed
from tests.dp_training import FP32_TOL, OPT, assert_params_close, build, global_batches, reference, train_pp1
from tests.gpt_fixtures import full_weights, tiny_config

DIST = dataclasses.replace(OPT, use_distributed_optimizer=True)


def test_shard_ranges_match_megatron_example() -> None:
    """The seed's figure: 4 params (4 + 5 + 3 + 4 = 16 elements, reverse order), d = 4."""
    sizes = [4, 3, 5, 4]  # module order; the buffer holds them reversed: 4 | 5 | 3 | 4
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    buf = GradBuffer(params, grad_dtype=torch.float16, dp_size=4)
    assert buf.numel == 16
    r0 = buffer_shard_ranges(buf, 0, 4)
    r1 = buffer_shard_ranges(buf, 1, 4)
    p_second = params[2]  # the 5-element parameter occupies world [4, 9)
    assert id(p_second) not in r0
    assert r1[id(p_second)].world == Range(4, 8) and r1[id(p_second)].param == Range(0, 4)
    assert r1[id(p_second)].local == Range(0, 4)
    r2 = buffer_shard_ranges(buf, 2, 4)
    assert r2[id(p_second)].world == Range(8, 9) and r2[id(p_second)].param == Range(4, 5)
    assert r2[id(params[1])].world == Range(9, 12) and r2[id(params[1])].local == Range(1, 4)
    # Every element is owned by exactly one rank.
    owned = sorted(
        (r.world.start, r.world.end) for k in range(4) for r in buffer_shard_ranges(buf, k, 4).values()
    )
    assert sum(e - s for s, e in owned) == 16


def _train_and_shard(rank: int, world: int, tp: int, cfg, weights, batches):
    ps = ParallelState.from_distributed(ParallelConfig(tp=tp), seed=0)
    model, ddp, opt = build(
        ps, cfg, weights, DDPConfig(use_distributed_optimizer=True, shard_alignment=8), DIST
    )
    train_pp1(ps, model, ddp, opt, batches, num_micro=1)
    unpadded = sum(b.numel_unpadded for b in ddp.buffers)
    padded = sum(b.numel for b in ddp.buffers)
    state_numel = sum(t.numel() for st in opt.adam.state.values() for k, t in st.items() if k != "step")
    main_numel = sum(m.main.numel() for m in opt.mains)
    return {
        "shard": opt.sharded_state_dict(),
        "unpadded": unpadded,
        "padded": padded,
        "state_numel": state_numel,
        "main_numel": main_numel,
        "tp_rank": ps.tp_rank,
        "dp_rank": ps.dp_rank,
    }


def _reference_state(cfg, weights, batches):
    _, _, opt = reference(cfg, weights, batches, OPT)
    return opt.state_dict()


@pytest.mark.slow
def test_state_sizes_and_reassembled_state_equal_non_distributed() -> None:
    cfg = tiny_config()
    weights, batches = full_weights(cfg), global_batches(cfg, steps=2)
    ref = _reference_state(cfg, weights, batches)
    results = run_distributed(_train_and_shard, 4, 1, cfg, weights, batches)
    d = 4
    for r in results:
        # Each rank's state covers exactly 1/d of the padded buffer; padding is < d * alignment.
        assert r["padded"] % d == 0 and 0 <= r["padded"] - r["unpadded"] < d * 8
        shard_numel = sum(b["param"].numel() for b in r["shard"]["buffers"])
        assert shard_numel * d == r["padded"]
        assert r["state_numel"] == 2 * r["main_numel"] and r["main_numel"] <= shard_numel
    assert sum(r["main_numel"] for r in results) == results[0]["unpadded"]  # no element twice
    full = reassemble_full_state([r["shard"] for r in reversed(results)])
    assert full["step"] == ref["step"] == 2
    assert set(full["params"]) == set(ref["params"])
    for key, st in ref["params"].items():
        for k in ("param", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                full["params"][key][k], st[k], **FP32_TOL, msg=lambda m, n=key: f"{n}: {m}"
            )


@pytest.mark.slow
def test_reassembled_state_with_tensor_parallel() -> None:
    """tp=2 x dp=2: per TP rank, the DP shards reassemble into that TP rank's full-model shard."""
    cfg = tiny_config()
    weights, batches = full_weights(cfg), global_batches(cfg, steps=2)
    ref = _reference_state(cfg, weights, batches)
    results = run_distributed(_train_and_shard, 4, 2, cfg, weights, batches)
    for tp_rank in range(2):
        full = reassemble_full_state([r["shard"] for r in results if r["tp_rank"] == tp_rank])
        for key in (
            "model0.language_model.encoder.layers.1.mlp.dense_h_to_4h.weight",
            "model0.language_model.encoder.layers.0.self_attention.dense.bias",
        ):
            got, want = full["params"][key]["exp_avg_sq"], ref["params"][key]["exp_avg_sq"]
            if "dense_h_to_4h" in key:  # column-parallel: rows split over TP
                want = want.chunk(2, dim=0)[tp_rank]
            torch.testing.assert_close(got, want, **FP32_TOL)


def _save_load_continue(rank: int, world: int, cfg, weights, batches, shard_dir: str):
    ps = ParallelState.from_distributed(ParallelConfig(tp=1), seed=0)
    ddp_cfg = DDPConfig(use_distributed_optimizer=True)
    model, ddp, opt = build(ps, cfg, weights, ddp_cfg, DIST)
    train_pp1(ps, model, ddp, opt, batches[:2], num_micro=1)
    torch.save(opt.sharded_state_dict(), f"{shard_dir}/distrib_optim_{rank}.pt")
    saved_params = gather_full_state_dict(model)
    # A fresh model with different weights and optimizer state, restored from the shard.
    fresh, fddp, fopt = build(ps, cfg, {k: v * 0 for k, v in weights.items()}, ddp_cfg, DIST)
    for p, q in zip(fresh.parameters(), model.parameters(), strict=True):
        p.data.copy_(q.data)  # model weights come from the model checkpoint
    fopt.load_sharded_state_dict(torch.load(f"{shard_dir}/distrib_optim_{rank}.pt", weights_only=True))
    train_pp1(ps, fresh, fddp, fopt, batches[2:], num_micro=1)
    return {"params": gather_full_state_dict(fresh), "saved": saved_params}


@pytest.mark.slow
def test_per_shard_save_load_resumes_exactly(tmp_path) -> None:
    cfg = tiny_config()
    weights, batches = full_weights(cfg), global_batches(cfg, steps=3)
    ref, _, _ = reference(cfg, weights, batches, OPT)
    results = run_distributed(_save_load_continue, 2, cfg, weights, batches, str(tmp_path))
    for r in results:
        assert_params_close(r["params"], ref)


def _full_load_continue(rank: int, world: int, cfg, weights, batches, state):
    """Each DP rank takes its element ranges of a full (non-distributed) state, then trains on."""
    ps = ParallelState.from_distributed(ParallelConfig(tp=1), seed=0)
    model, ddp, opt = build(
        ps, cfg, {k: v * 0 for k, v in weights.items()}, DDPConfig(use_distributed_optimizer=True), DIST
    )
    opt.load_full_state_dict(state)  # also sets the model weights (main params, all-gathered)
    train_pp1(ps, model, ddp, opt, batches, num_micro=1)
    return {"params": gather_full_state_dict(model)}


@pytest.mark.slow
def test_full_state_loads_into_distributed_optimizer_and_resumes_exactly() -> None:
    cfg = tiny_config()
    weights, batches = full_weights(cfg), global_batches(cfg, steps=3)
    ref, _, _ = reference(cfg, weights, batches, OPT)
    _, _, opt = reference(cfg, weights, batches[:2], OPT)
    results = run_distributed(_full_load_continue, 2, cfg, weights, batches[2:], opt.state_dict())
    for r in results:
        assert_params_close(r["params"], ref)
