"""Expert parallelism (issue 27): megatron-core's expert groups, and EP / ETP training equal to one
process on loss, every gradient and the optimizer steps (plain and ZeRO-1)."""

from __future__ import annotations

import dataclasses
import itertools
from contextlib import nullcontext
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from pretrain.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads, global_loss_tokens
from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.optim import build_optimizer
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.layout import compute_layout
from pretrain.parallel.layout_cli import main as layout_main
from pretrain.parallel.state import ParallelState
from pretrain.utils.errors import UserError
from tests.distributed import run_distributed
from tests.dp_training import OPT, global_batches, local_microbatches, masked_sum_loss
from tests.test_moe_parallel import moe_config, moe_weights

TOL = {"rtol": 1e-5, "atol": 1e-6}


# ------------------------------------------------------------------ layout: megatron-core's groups


def megatron_core_groups(
    world: int, tp: int, pp: int, ep: int, etp: int | None
) -> dict[str, list[list[int]]]:
    """Every group megatron-core 0.16.1's ``initialize_model_parallel`` creates for ``world`` ranks,
    by description, recorded from its ``new_group`` calls (no processes: the group objects are stubs)."""
    from megatron.core import parallel_state as mps

    made: dict[str, list[list[int]]] = {}

    def new_group(ranks: Any = None, **kw: Any) -> object:
        made.setdefault(str(kw.get("group_desc")), []).append(list(ranks))
        return object()

    with (
        mock.patch.object(dist, "new_group", new_group),
        mock.patch.object(dist, "get_world_size", lambda *a, **k: world),
        mock.patch.object(dist, "get_rank", lambda *a, **k: 0),
        mock.patch.object(dist, "is_initialized", lambda: True),
    ):
        try:
            mps.initialize_model_parallel(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp, create_gloo_process_groups=False,
            )  # fmt: skip
        finally:
            mps.destroy_model_parallel()
    return made


WORLDS = [  # (world, tp, pp, ep, etp)
    (4, 1, 1, 4, None), (4, 1, 1, 2, None), (4, 2, 1, 2, None), (4, 2, 1, 2, 1), (4, 1, 2, 2, None),
    (8, 2, 2, 2, None), (16, 2, 2, 4, 1), (16, 4, 1, 2, None), (32, 2, 4, 2, 1), (8, 2, 1, 4, 1),
    # ETP independent of TP (megatron-core allows any): smaller, larger, with and without EP
    (2, 1, 1, 1, 2), (4, 1, 1, 2, 2), (2, 2, 1, 1, 1), (4, 4, 1, 1, 2), (8, 4, 1, 2, 2), (4, 2, 1, 1, 4),
    (8, 2, 2, 1, 4), (8, 4, 2, 1, 2), (8, 1, 2, 2, 2), (16, 2, 1, 2, 4),
]  # fmt: skip


@pytest.mark.parametrize(("world", "tp", "pp", "ep", "etp"), WORLDS)
def test_expert_groups_equal_megatron_cores(world: int, tp: int, pp: int, ep: int, etp: int | None) -> None:
    peer = megatron_core_groups(world, tp, pp, ep, etp)
    ours = compute_layout(world_size=world, tp=tp, pp=pp, ep=ep, etp=etp).as_dict()
    pairs = {
        "ep": "EXPERT_MODEL_PARALLEL_GROUP", "etp": "EXPERT_TENSOR_PARALLEL_GROUP",
        "edp": "EXPERT_DATA_PARALLEL_GROUP", "expert_model_parallel": "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
        "tp": "TENSOR_MODEL_PARALLEL_GROUP", "dp": "DATA_PARALLEL_GROUP", "pp": "PIPELINE_MODEL_PARALLEL_GROUP",
    }  # fmt: skip
    for kind, desc in pairs.items():
        assert ours[kind] == peer[desc], (kind, ours[kind], peer[desc])


def test_expert_coordinates_and_cli(capsys: pytest.CaptureFixture[str]) -> None:
    lay = compute_layout(world_size=8, tp=2, pp=1, ep=4, etp=1)
    for r in range(8):
        etp_rank, ep_rank, edp_rank = lay.expert_coords(r)
        assert r in lay.ep_groups[lay.ep_groups.index(lay.group_containing("ep", r))]
        assert lay.group_containing("ep", r)[ep_rank] == r and lay.group_containing("edp", r)[edp_rank] == r
        assert etp_rank == 0
    assert (
        layout_main(["--world-size", "8", "--tp", "2", "--expert-model-parallel-size", "4", "--etp", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "ep groups" in out and "edp groups" in out and "etp 1 x ep 4 x edp 2" in out
    with pytest.raises(SystemExit) as exc:
        layout_main(["--world-size", "6", "--ep", "4"])
    assert exc.value.code == 2
    assert "--expert-model-parallel-size 4" in capsys.readouterr().err
    with pytest.raises(UserError, match="--expert-model-parallel-size must be a positive"):
        ParallelConfig(ep=0)


# ------------------------------------------------------------------ training equals one process


def _step_worker(
    rank: int, world: int, par: ParallelConfig, cfg, weights, batches, ddp_cfg, opt_cfg, micro: int
):
    """pp = 1: per step the global loss, (first step) every full gradient, the norm; then params."""
    ps = ParallelState.from_distributed(par, seed=0)
    model = GPTModel(cfg, ps)
    load_full_state_dict(model, weights)
    ddp = DistributedDataParallel(model, ps, ddp_cfg)
    opt = build_optimizer(opt_cfg, [ddp], ps)
    losses, grads, steps = [], None, []
    for data in batches:
        mbs = local_microbatches(data, ps, micro)
        n_tokens = global_loss_tokens([m["loss_mask"] for m in mbs], ps)
        opt.zero_grad()
        total = torch.zeros(())
        for i, mb in enumerate(mbs):
            with ddp.no_sync() if i < micro - 1 else nullcontext():
                loss = masked_sum_loss(model(mb["tokens"], labels=mb["labels"]), mb["loss_mask"], n_tokens)
                opt.scale_loss(loss).backward()
                total += loss.detach()
        finalize_model_grads([ddp])
        if ps.dp_group is not None:
            dist.all_reduce(total, group=ps.dp_group)
        losses.append(total)
        if grads is None and not ddp_cfg.use_distributed_optimizer:
            grads = {k: v.clone() for k, v in gather_full_state_dict(model, grads=True).items()}  # not views
        steps.append(opt.step()[:2])
    return {"losses": losses, "grads": grads, "steps": steps, "params": gather_full_state_dict(model)}


def _merged(results: list[dict[str, Any]], key: str) -> dict[str, torch.Tensor]:
    """Every rank's canonical tensors in one dict; copies held by several ranks must agree."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        for name, v in (r[key] or {}).items():
            if name in out:
                torch.testing.assert_close(v, out[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
            out[name] = v
    return out


def _check(results: list[dict[str, Any]], ref: dict[str, Any], *, grads: bool) -> None:
    for r in results:
        for got, want in zip(r["losses"], ref["losses"], strict=True):
            torch.testing.assert_close(got, want, **TOL)
        for (ok, norm), (_, ref_norm) in zip(r["steps"], ref["steps"], strict=True):
            assert ok and norm == pytest.approx(ref_norm, rel=1e-5)
    pairs = [("params", ref["params"])] + ([("grads", ref["grads"])] if grads else [])
    for key, want_all in pairs:
        got_all = _merged(results, key)
        assert set(got_all) == set(want_all), key
        assert any(".mlp.experts.3." in n for n in got_all)
        for name, want in want_all.items():
            torch.testing.assert_close(
                got_all[name], want, **TOL, msg=lambda m, n=name, k=key: f"{k} {n}: {m}"
            )


def _reference(cfg, weights, batches, opt_cfg) -> dict[str, Any]:
    """The same loop in one process, each global batch as one microbatch, plain optimizer."""
    ps = ParallelState.single()
    dist_free = dataclasses.replace(opt_cfg, use_distributed_optimizer=False)
    return _step_worker_single(ps, cfg, weights, batches, dist_free)


def _step_worker_single(ps: ParallelState, cfg, weights, batches, opt_cfg) -> dict[str, Any]:
    with mock.patch.object(ParallelState, "from_distributed", lambda *a, **k: ps):
        return _step_worker(0, 1, ParallelConfig(), cfg, weights, batches, DDPConfig(), opt_cfg, 1)


LAYOUTS: dict[str, tuple[int, ParallelConfig, dict[str, Any]]] = {  # name: (world, layout, model options)
    "ep2": (2, ParallelConfig(ep=2), {}),
    "ep2_recompute": (2, ParallelConfig(ep=2), {"recompute_activations": True}),
    "dp4_ep4": (4, ParallelConfig(ep=4), {}),
    "dp4_ep2": (4, ParallelConfig(ep=2), {}),
    "tp2_ep2": (4, ParallelConfig(tp=2, ep=2), {}),
    "tp2_ep2_etp1": (4, ParallelConfig(tp=2, ep=2, etp=1), {}),
    "tp2_etp1": (2, ParallelConfig(tp=2, etp=1), {}),
    # ETP independent of TP: experts split over other ranks than the dense layers
    "tp1_etp2": (2, ParallelConfig(tp=1, etp=2), {}),
    "tp1_etp2_ep2": (4, ParallelConfig(tp=1, ep=2, etp=2), {}),
    "tp4_etp2": (4, ParallelConfig(tp=4, etp=2), {"num_query_groups": 4}),
    "tp2_etp4": (4, ParallelConfig(tp=2, etp=4), {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("zero1", [False, True], ids=["plain", "zero1"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_expert_parallel_training_equals_single_process(layout: str, zero1: bool) -> None:
    world, par, options = LAYOUTS[layout]
    cfg = moe_config(**options)
    weights, batches = moe_weights(cfg), global_batches(cfg, steps=2)
    opt_cfg = dataclasses.replace(OPT, use_distributed_optimizer=zero1)
    ref = _reference(cfg, weights, batches, opt_cfg)
    ddp_cfg = DDPConfig(use_distributed_optimizer=zero1)
    results = run_distributed(_step_worker, world, par, cfg, weights, batches, ddp_cfg, opt_cfg, 2)
    _check(results, ref, grads=not zero1)


@pytest.mark.slow
def test_overlapped_bucketed_reduction_with_expert_buffers_equals_single_process() -> None:
    """Dense buckets (DP group) and expert buckets (expert-DP group) launched asynchronously as
    their gradients become ready, ZeRO-1: the same result."""
    cfg = moe_config()
    weights, batches = moe_weights(cfg), global_batches(cfg, steps=2)
    opt_cfg = dataclasses.replace(OPT, use_distributed_optimizer=True)
    ref = _reference(cfg, weights, batches, opt_cfg)
    ddp_cfg = DDPConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=3000)
    results = run_distributed(
        _step_worker, 4, ParallelConfig(ep=2), cfg, weights, batches, ddp_cfg, opt_cfg, 2
    )
    _check(results, ref, grads=False)


def _pp_worker(
    rank: int, world: int, par: ParallelConfig, cfg, weights, batches, ddp_cfg, opt_cfg, micro: int
):
    from pretrain.pipeline.embedding_sync import allreduce_embedding_grads
    from pretrain.pipeline.partition import build_model_chunks
    from pretrain.pipeline.schedules import forward_backward

    ps = ParallelState.from_distributed(par, seed=0)
    chunks = build_model_chunks(cfg, ps)
    for c in chunks:
        load_full_state_dict(c, weights, strict=True)
    ddps = [DistributedDataParallel(c, ps, ddp_cfg) for c in chunks]
    opt = build_optimizer(opt_cfg, ddps, ps)
    for d in ddps:
        d.grad_accumulation_steps = micro
    losses, grads, steps = [], [], []
    for data in batches:
        mbs = local_microbatches(data, ps, micro)
        n_tokens = global_loss_tokens([m["loss_mask"] for m in mbs], ps)
        opt.zero_grad()
        total = torch.zeros(())

        def loss_fn(out: torch.Tensor, mb: dict[str, Any], n: float = n_tokens) -> torch.Tensor:
            nonlocal total
            loss = masked_sum_loss(out, mb["loss_mask"], n)
            total = total + loss.detach()
            return opt.scale_loss(loss)

        def finalize() -> None:
            finalize_model_grads(ddps, embedding_sync=lambda: allreduce_embedding_grads(chunks, ps))
            if not grads and not ddp_cfg.use_distributed_optimizer:
                grads.extend(
                    {k: v.clone() for k, v in gather_full_state_dict(c, grads=True).items()} for c in chunks
                )

        forward_backward(chunks=chunks, ps=ps, microbatches=mbs, loss_fn=loss_fn, finalize_grads=finalize)
        if ps.dp_group is not None:
            dist.all_reduce(total, group=ps.dp_group)
        losses.append(total)
        steps.append(opt.step()[:2])
    params = {k: v for c in chunks for k, v in gather_full_state_dict(c).items()}
    last = ps.is_last_stage
    return {"losses": losses if last else None, "grads": {k: v for g in grads for k, v in g.items()},
            "steps": steps, "params": params}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("zero1", [False, True], ids=["plain", "zero1"])
@pytest.mark.parametrize("vp", [1, 2], ids=["pp2", "pp2_vp2"])
def test_pp2_ep2_training_equals_single_process(vp: int, zero1: bool) -> None:
    cfg = moe_config(num_layers=4)
    weights, batches = moe_weights(cfg), global_batches(cfg, steps=2)
    opt_cfg = dataclasses.replace(OPT, use_distributed_optimizer=zero1)
    ref = _reference(cfg, weights, batches, opt_cfg)
    ddp_cfg = DDPConfig(use_distributed_optimizer=zero1)
    results = run_distributed(
        _pp_worker, 4, ParallelConfig(pp=2, vp=vp, ep=2), cfg, weights, batches, ddp_cfg, opt_cfg, 2
    )
    lasts = [r for r in results if r["losses"] is not None]
    assert len(lasts) == 2
    for r in results:
        if r["losses"] is None:
            r["losses"] = lasts[0]["losses"]
    _check(results, ref, grads=not zero1)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "par"),
    [
        (2, ParallelConfig(ep=2)),
        (4, ParallelConfig(tp=2, ep=2, etp=1)),
        (4, ParallelConfig(ep=2, etp=2)),
        (4, ParallelConfig(tp=4, etp=2)),
    ],
    ids=["ep2", "tp2_ep2_etp1", "tp1_ep2_etp2", "tp4_etp2"],
)
def test_router_losses_and_token_dropping_under_ep_equal_dp(world: int, par: ParallelConfig) -> None:
    """Aux and z losses and capacity-factor token dropping work on each rank's own tokens (as
    Megatron's, before dispatch): with EP they equal the same data-parallel run without EP
    (which equals one process, tests/test_moe_router_losses.py)."""
    cfg = moe_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, moe_expert_capacity_factor=1.0,
                     num_query_groups=max(2, par.tp))  # fmt: skip
    weights, batches = moe_weights(cfg), global_batches(cfg, steps=2)
    args = (cfg, weights, batches, DDPConfig(), OPT, 2)
    want = run_distributed(_pp_worker, world, dataclasses.replace(par, ep=1, etp=None), *args)
    got = run_distributed(_pp_worker, world, par, *args)
    ref = {**want[0], "params": _merged(want, "params"), "grads": _merged(want, "grads")}
    _check(got, ref, grads=True)


def test_bad_expert_layouts_are_refused() -> None:
    cfg = moe_config()
    lay = compute_layout(world_size=6, tp=1, pp=1, ep=3)
    with pytest.raises(UserError, match="--num-experts 4 is not divisible by --expert-model-parallel-size 3"):
        GPTModel(cfg, ParallelState(layout=lay, rank=0))
    lay = compute_layout(world_size=6, tp=1, pp=1, ep=1, etp=3)
    with pytest.raises(
        UserError, match="--moe-ffn-hidden-size 16 is not divisible by --expert-tensor-parallel-size 3"
    ):
        GPTModel(cfg, ParallelState(layout=lay, rank=0))
    assert list(itertools.chain(*compute_layout(world_size=4, tp=1, pp=1, ep=2).ep_groups)) == [0, 1, 2, 3]


# ------------------------------------------------------------------ mlm-pretrain under torchrun

MOE_FLAGS = {
    "normalization": "RMSNorm", "swiglu": True, "position-embedding-type": "rope",
    "untie-embeddings-and-output-weights": True, "disable-bias-linear": True, "ffn-hidden-size": 48,
    "num-experts": 4, "moe-router-topk": 2, "moe-ffn-hidden-size": 16, "num-layers": 2,
    "expert-model-parallel-size": 2, "use-distributed-optimizer": True, "adam-eps": 1e-5,
}  # fmt: skip


@pytest.mark.slow
def test_mlm_pretrain_with_expert_parallelism_resumes_bitwise(
    gpt_data: dict[str, str], tmp_path, capsys
) -> None:
    import json

    from tests.distributed import launch
    from tests.train_fixtures import gpt_args

    def run(iters: int, name: str, **kw: object) -> list[float]:
        log = tmp_path / f"{name}.jsonl"
        argv = gpt_args(gpt_data, **MOE_FLAGS, **{"train-iters": iters, "log-json": log, **kw})  # type: ignore[arg-type]
        proc = launch(2, "pretrain.training.cli", argv)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]

    full = run(4, "full", save=tmp_path / "full")
    first = run(2, "a", save=tmp_path / "ck")
    assert sorted(p.name for p in (tmp_path / "ck" / "iter_0000002").iterdir()) == [
        "mp_rank_00_000",
        "mp_rank_00_001",
    ]
    from pretrain.training.cli import main as pretrain_main

    other = gpt_args(gpt_data, **{**MOE_FLAGS, "expert-model-parallel-size": 1, "train-iters": 4,
                                  "load": tmp_path / "ck", "save": tmp_path / "other"})  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        pretrain_main(other)  # one process, EP 1: refused before any work
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "saved with expert parallelism ep=2 etp=1, this run uses ep=1" in err[0], err
    second = run(4, "b", load=tmp_path / "ck", save=tmp_path / "ck")
    assert first + second == full  # bitwise: the same floats
    for rank_dir in ("mp_rank_00_000", "mp_rank_00_001"):
        want = torch.load(
            tmp_path / "full" / "iter_0000004" / rank_dir / "model_optim_rng.pt", weights_only=False
        )
        got = torch.load(
            tmp_path / "ck" / "iter_0000004" / rank_dir / "model_optim_rng.pt", weights_only=False
        )
        flat_w, flat_g = _flat(want["model"]), _flat(got["model"])
        assert set(flat_w) == set(flat_g) and any("experts" in k for k in flat_w)
        for k, v in flat_w.items():
            assert torch.equal(flat_g[k], v), (rank_dir, k)


@pytest.mark.slow
def test_mlm_pretrain_at_etp_below_tp_resumes_bitwise(gpt_data: dict[str, str], tmp_path) -> None:
    """TP 2 with whole experts (ETP 1), ZeRO-1: rank files mp_rank_00/01 each hold the whole
    experts (expert-TP shard t % 1), ETP 1 in args; resuming continues bit for bit. A layout whose
    expert shards no rank file can hold (ETP 2 > TP 1) is refused before any work."""
    import json

    from pretrain.checkpoint.opener import load_canonical
    from tests.distributed import launch, torchrun
    from tests.train_fixtures import gpt_args

    flags = {**MOE_FLAGS, "expert-model-parallel-size": 1, "tensor-model-parallel-size": 2,
             "expert-tensor-parallel-size": 1}  # fmt: skip

    def run(iters: int, name: str, **kw: object) -> list[float]:
        log = tmp_path / f"{name}.jsonl"
        argv = gpt_args(gpt_data, **flags, **{"train-iters": iters, "log-json": log, **kw})  # type: ignore[arg-type]
        proc = launch(2, "pretrain.training.cli", argv)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]

    full = run(4, "full")
    first = run(2, "a", save=tmp_path / "ck")
    it = tmp_path / "ck" / "iter_0000002"
    assert sorted(p.name for p in it.iterdir()) == ["mp_rank_00", "mp_rank_01"]
    state = torch.load(it / "mp_rank_01" / "model_optim_rng.pt", weights_only=False)
    assert state["args"].expert_tensor_parallel_size == 1
    weights, _, _ = load_canonical(tmp_path / "ck")  # both TP files' whole experts agree
    assert any(".mlp.experts.3." in k for k in weights)
    second = run(4, "b", load=tmp_path / "ck", save=tmp_path / "ck")
    assert first + second == full  # bitwise: the same floats
    argv = gpt_args(gpt_data, **{**MOE_FLAGS, "expert-model-parallel-size": 1, "expert-tensor-parallel-size": 2,
                                 "train-iters": 2, "save": tmp_path / "etp2"})  # fmt: skip
    proc = torchrun(2, "pretrain.training.cli", argv)
    assert proc.returncode != 0 and "(exitcode: 2)" in proc.stderr  # the launcher reports the ranks' exit 2
    words = "--expert-tensor-parallel-size 2 does not divide --tensor-model-parallel-size 1: checkpoint rank files"
    assert {line for line in proc.stderr.splitlines() if line.startswith("error:")} == {
        f"error: --save {tmp_path / 'etp2'}: {words} (mp_rank_TT[_PPP][_EEE]) cannot hold such expert shards; "
        "use an ETP dividing TP"
    }, proc.stderr[-2000:]
    assert not (tmp_path / "etp2").exists()


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def test_megatron_args_carry_the_expert_layout() -> None:
    from pretrain.checkpoint.metadata import parallel_of

    args = {
        "tensor_model_parallel_size": 2,
        "expert_model_parallel_size": 4,
        "expert_tensor_parallel_size": 1,
    }
    assert parallel_of(args) == ParallelConfig(tp=2, ep=4, etp=1)
    # Megatron records ETP = TP when not set: the same layout as ours by default
    assert parallel_of({**args, "expert_tensor_parallel_size": 2}) == ParallelConfig(tp=2, ep=4)
    assert parallel_of({"tensor_model_parallel_size": 2}) == ParallelConfig(tp=2)


def test_mlm_pretrain_refuses_experts_that_do_not_split(gpt_data: dict[str, str], capsys) -> None:
    from pretrain.training.cli import main as pretrain_main
    from tests.train_fixtures import gpt_args

    argv = gpt_args(gpt_data, **{**MOE_FLAGS, "expert-model-parallel-size": 3})  # type: ignore[arg-type]
    with pytest.raises(SystemExit) as exc:
        pretrain_main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--num-experts 4 is not divisible by --expert-model-parallel-size 3" in err[0]
