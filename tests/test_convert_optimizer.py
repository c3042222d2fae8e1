"""Optimizer resharding end to end: a distributed-optimizer run at tp=2, pp=2 resumes at tp=1, pp=4.

Flags that make the comparison meaningful: fp32, dropout 0, constant LR (the scheduler state is
carried anyway) and ``--adam-eps 1e-5``. The key bias has an exactly-zero gradient in exact
arithmetic (softmax ignores a per-query constant), so its computed gradient is pure round-off
(~1e-10) that differs between layouts; with eps 1e-8 Adam's ``m / (sqrt(v) + eps)`` can turn that
into steps of size ~lr, making parameters of two layouts differ for no real reason. eps 1e-5 damps
them to ~1e-5 * lr. (In this tiny configuration eps 1e-8 also passed when tried; 1e-5 keeps the
test robust.) The loss is unaffected either way. Step 4's loss depends only on the weights; step
5's loss and the final weights depend on the resharded optimizer state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.legacy.layout import DISTRIB_OPTIM_FILE, MODEL_FILE
from pretrain.checkpoint.opener import load_canonical
from pretrain.training.cli import main as pretrain_main
from tests.distributed import launch
from tests.train_fixtures import gpt_args
from tools.convert_cli import main as convert_main

pytestmark = pytest.mark.slow  # torchrun launches
FLAGS = {"adam-eps": 1e-5, "train-iters": 5, "micro-batch-size": 2, "global-batch-size": 4}


@pytest.fixture(scope="module")
def data(gpt_data: dict[str, str]) -> dict[str, str]:
    return gpt_data


def _losses(path: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def _torchrun(nproc: int, flags: list[str]) -> None:
    proc = launch(nproc, "pretrain.training.cli", flags)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _reshard(src: Path, dst: Path, tp: int, pp: int, iteration: int) -> None:
    argv = ["reshard", "--load", str(src), "--save", str(dst), "--target-tp", str(tp), "--target-pp", str(pp)]
    assert convert_main([*argv, "--iteration", str(iteration), "--with-optimizer"]) == 0


def test_distributed_optimizer_resharded_resumes_with_same_loss_and_params(
    data: dict[str, str], tmp_path: Path
) -> None:
    # 5 steps at tp=2, pp=2 with the distributed optimizer, saving after step 3 (and at the end).
    ref = gpt_args(data, **FLAGS, **{"tp": 2, "pp": 2, "use-distributed-optimizer": True,
                                     "save": tmp_path / "a", "save-interval": 3, "log-json": tmp_path / "a.jsonl"})  # fmt: skip
    _torchrun(4, ref)
    assert (tmp_path / "a/iter_0000003/mp_rank_01_001" / DISTRIB_OPTIM_FILE).is_file()
    _reshard(tmp_path / "a", tmp_path / "b", 1, 4, 3)
    saved = torch.load(tmp_path / "b/iter_0000003/mp_rank_00_002" / MODEL_FILE, weights_only=True)
    assert saved["optimizer"]["step"] == 3 and not saved["optimizer"].get("distributed")
    assert "rng_state" in saved  # reshard carries each rank file's RNG state (Megatron resumes from it)
    assert not list((tmp_path / "b").rglob(DISTRIB_OPTIM_FILE))
    # 2 more steps at tp=1, pp=4, again with the distributed optimizer (it takes its element ranges).
    # Step 4's loss checks the weights; step 5's loss and the final weights check the optimizer state.
    resumed = gpt_args(data, **FLAGS, **{"pp": 4, "use-distributed-optimizer": True, "load": tmp_path / "b",
                                         "save": tmp_path / "c", "log-json": tmp_path / "c.jsonl"})  # fmt: skip
    _torchrun(4, resumed)
    a, c = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "c.jsonl")
    assert len(a) == 5 and len(c) == 2
    torch.testing.assert_close(torch.tensor(c), torch.tensor(a[3:]), rtol=1e-5, atol=0)
    want, _, _ = load_canonical(tmp_path / "a", iteration=5)
    got, _, info = load_canonical(tmp_path / "c", iteration=5)
    assert (info.tp, info.pp) == (1, 4) and set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=1e-4, atol=1e-6, msg=f"{name} differs")


def test_non_distributed_optimizer_resumes_from_distrib_optim_shards(
    data: dict[str, str], tmp_path: Path
) -> None:
    """The reverse: a single-process, non-distributed run resumes a dp=2 distributed-optimizer
    checkpoint by reassembling its ``distrib_optim.pt`` shards."""
    ref = gpt_args(data, **FLAGS, **{"use-distributed-optimizer": True, "save": tmp_path / "a",
                                     "save-interval": 3, "log-json": tmp_path / "a.jsonl"})  # fmt: skip
    _torchrun(2, ref)
    shards = torch.load(tmp_path / "a/iter_0000003/mp_rank_00" / DISTRIB_OPTIM_FILE, weights_only=True)
    assert len(shards["shards"]) == 2
    (tmp_path / "a/latest_checkpointed_iteration.txt").write_text("3")
    resumed = gpt_args(data, **FLAGS, **{"load": tmp_path / "a", "log-json": tmp_path / "b.jsonl"})
    assert pretrain_main(resumed) == 0
    a, b = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "b.jsonl")
    assert len(b) == 2
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a[3:]), rtol=1e-5, atol=0)
    # Without the optimizer state step 5 differs: these comparisons (and the ones above) can fail.
    fresh = gpt_args(data, **FLAGS, **{"load": tmp_path / "a", "no-load-optim": True,
                                       "log-json": tmp_path / "c.jsonl"})  # fmt: skip
    assert pretrain_main(fresh) == 0
    c = _losses(tmp_path / "c.jsonl")
    assert c[0] == pytest.approx(a[3], rel=1e-5) and abs(c[1] - a[4]) > 1e-4 * abs(a[4])
