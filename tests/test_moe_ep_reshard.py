"""Issue 27: ZeRO-1 optimizer state of expert parameters (sharded over each EP rank's expert-DP
group) resharded across expert-parallel layouts with ``mlm-convert reshard --with-optimizer``, and
resumed by ``mlm-pretrain`` (torchrun, CPU/gloo)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed import launch
from tests.test_moe_ep import MOE_FLAGS
from tests.train_fixtures import gpt_args
from tools.convert_cli import main as convert_main

ROUND = {"save-interval": 2}


def _train(gpt_data: dict[str, str], tmp_path: Path, name: str, iters: int, **kw: object) -> list[float]:
    log = tmp_path / f"{name}.jsonl"
    argv = gpt_args(gpt_data, **{**MOE_FLAGS, "train-iters": iters, "log-json": log, **kw})  # type: ignore[arg-type]
    proc = launch(2, "pretrain.training.cli", argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]


def _reshard(src: Path, dst: Path, ep: int, *extra: str, tp: int = 1) -> None:
    argv = ["reshard", "--load", str(src), "--save", str(dst), "--target-tp", str(tp), "--target-pp", "1",
            "--target-ep", str(ep), "--with-optimizer", *extra]  # fmt: skip
    assert convert_main(argv) == 0


def _rank_files(root: Path, iteration: int) -> dict[str, dict[str, torch.Tensor]]:
    from tests.test_moe_ep import _flat

    it = root / f"iter_{iteration:07d}"
    return {
        d.name: _flat(torch.load(d / "model_optim_rng.pt", weights_only=False)["model"])
        for d in sorted(it.iterdir())
    }


@pytest.mark.slow
def test_zero1_expert_state_resharded_across_ep_resumes(gpt_data: dict[str, str], tmp_path: Path) -> None:
    # EP 2 on 2 ranks: dense state sharded over DP 2, each EP rank's experts over its expert DP (1)
    full = _train(gpt_data, tmp_path, "full", 4, save=tmp_path / "full", **ROUND)
    assert len(full) == 4
    _reshard(tmp_path / "full", tmp_path / "ep1", 1, "--iteration", "2")
    _reshard(tmp_path / "ep1", tmp_path / "ep2", 2)
    # EP 2 -> EP 1 -> EP 2 loses nothing: the resumed run is the uninterrupted one, bitwise
    back = _train(gpt_data, tmp_path, "back", 4, load=tmp_path / "ep2", save=tmp_path / "back")
    assert back == full[2:]
    want, got = _rank_files(tmp_path / "full", 4), _rank_files(tmp_path / "back", 4)
    assert set(want) == set(got) == {"mp_rank_00_000", "mp_rank_00_001"}
    for rank_dir, tensors in want.items():
        assert any("experts" in k for k in tensors)
        for k, v in tensors.items():
            assert torch.equal(got[rank_dir][k], v), (rank_dir, k)
    # EP 1 (both ranks hold every expert, ZeRO-1 over DP 2): the expert gradients are now summed
    # over the two DP ranks instead of computed on the expert's one rank, so fp32 tolerance
    ep1 = _train(gpt_data, tmp_path, "ep1run", 4, load=tmp_path / "ep1", save=tmp_path / "ep1run",
                 **{"expert-model-parallel-size": 1})  # fmt: skip
    torch.testing.assert_close(torch.tensor(ep1), torch.tensor(full[2:]), rtol=1e-5, atol=0)
    merged = _rank_files(tmp_path / "ep1run", 4)["mp_rank_00"]
    per = 2  # experts per EP rank in the EP 2 run
    for rank_dir, tensors in want.items():
        e = int(rank_dir[-3:])
        for k, v in tensors.items():
            name = k
            if ".local_experts." in k:  # local index -> global
                head, tail = k.split(".local_experts.")
                idx, rest = tail.split(".", 1)
                name = f"{head}.local_experts.{int(idx) + e * per}.{rest}"
            torch.testing.assert_close(merged[name], v, rtol=1e-4, atol=1e-6, msg=name)
    # EP 2 -> TP 2 EP 1 (the experts' state split over TP like their weights)
    _reshard(tmp_path / "full", tmp_path / "tp2", 1, "--iteration", "2", tp=2)
    tp2 = _train(gpt_data, tmp_path, "tp2run", 4, load=tmp_path / "tp2",
                 **{"expert-model-parallel-size": 1, "tensor-model-parallel-size": 2})  # fmt: skip
    torch.testing.assert_close(torch.tensor(tp2), torch.tensor(full[2:]), rtol=1e-5, atol=0)
    # EP 2 -> EP 4 (one expert per EP rank file) -> EP 2: bitwise again
    _reshard(tmp_path / "full", tmp_path / "ep4", 4, "--iteration", "2")
    assert len(list((tmp_path / "ep4" / "iter_0000002").iterdir())) == 4
    _reshard(tmp_path / "ep4", tmp_path / "ep4to2", 2)
    assert _train(gpt_data, tmp_path, "ep4to2run", 4, load=tmp_path / "ep4to2") == full[2:]
    # the same ZeRO-1 shards resumed by the non-distributed optimizer (each rank its EP rank's experts)
    shutil.copytree(tmp_path / "full" / "iter_0000002", tmp_path / "at2" / "iter_0000002")
    (tmp_path / "at2" / "latest_checkpointed_iteration.txt").write_text("2")
    plain = {"use-distributed-optimizer": False, "load": tmp_path / "at2"}
    dense = _train(gpt_data, tmp_path, "plain", 4, **plain)
    torch.testing.assert_close(torch.tensor(dense), torch.tensor(full[2:]), rtol=1e-5, atol=0)


def _shard(dp_rank: int, ep_rank: int | None) -> dict[str, object]:
    """DP rank ``dp_rank`` of 2 (EP 2, expert DP 1): a dense buffer of 4 elements (2 each) and
    its EP rank's expert buffer of 2 elements (whole); values say rank and element."""
    dense = {"numel": 4, "buckets": [(0, 4)], "index": [("model0.w", (4,), 0, 4)]}
    expert = {"numel": 2, "buckets": [(0, 2)], "index": [("model0.mlp.experts.0.w", (2,), 0, 2)],
              "shard_rank": 0, "shard_size": 1, **({} if ep_rank is None else {"ep_rank": ep_rank})}  # fmt: skip
    flat = {k: torch.tensor([10.0 * dp_rank, 10.0 * dp_rank + 1]) for k in ("param", "exp_avg", "exp_avg_sq")}
    flat_e = {k: torch.tensor([100.0 * (1 + dp_rank), 100.0 * (1 + dp_rank) + 1]) for k in flat}
    return {"dp_rank": dp_rank, "dp_size": 2, "step": 3, "param_groups": [{}], "grad_scaler": None,
            "buffers": [{**dense, **flat}, {**expert, **flat_e}]}  # fmt: skip


def test_reassembly_picks_each_ep_ranks_expert_shards_and_refuses_unmarked_ones() -> None:
    from pretrain.optim.distrib_optimizer import reassemble_full_state

    shards = [_shard(1, 1), _shard(0, 0)]
    for e in (0, 1):
        params = reassemble_full_state(shards, ep_rank=e)["params"]
        assert params["model0.w"]["exp_avg"].tolist() == [0.0, 1.0, 10.0, 11.0]  # both DP ranks
        assert params["model0.mlp.experts.0.w"]["param"].tolist() == [100.0 * (1 + e), 100.0 * (1 + e) + 1]
    with pytest.raises(ValueError, match="do not record their EP rank"):
        reassemble_full_state([_shard(0, None), _shard(1, None)], ep_rank=0)


@pytest.mark.slow
def test_zero1_expert_state_at_etp_below_tp_resharded_resumes_bitwise(
    gpt_data: dict[str, str], tmp_path: Path
) -> None:
    """TP 2 with whole experts (ETP 1) on 2 ranks: the expert buffer is sharded over expert DP 2,
    which spans both TP ranks' ``distrib_optim.pt``. Reshard to TP 1 EP 2 and back to TP 2 ETP 1
    with the optimizer: the resumed run is the uninterrupted one, bit for bit."""
    etp1 = {
        "expert-model-parallel-size": 1,
        "tensor-model-parallel-size": 2,
        "expert-tensor-parallel-size": 1,
    }
    full = _train(gpt_data, tmp_path, "full", 4, save=tmp_path / "full", **ROUND, **etp1)
    _reshard(tmp_path / "full", tmp_path / "ep2", 2, "--iteration", "2")
    _reshard(tmp_path / "ep2", tmp_path / "back", 1, "--target-etp", "1", tp=2)
    assert sorted(p.name for p in (tmp_path / "back" / "iter_0000002").iterdir()) == [
        "mp_rank_00",
        "mp_rank_01",
    ]
    back = _train(gpt_data, tmp_path, "back", 4, load=tmp_path / "back", save=tmp_path / "backrun", **etp1)
    assert back == full[2:]
    want, got = _rank_files(tmp_path / "full", 4), _rank_files(tmp_path / "backrun", 4)
    assert set(want) == set(got) == {"mp_rank_00", "mp_rank_01"}
    for rank_dir, tensors in want.items():
        for k, v in tensors.items():
            assert torch.equal(got[rank_dir][k], v), (rank_dir, k)
