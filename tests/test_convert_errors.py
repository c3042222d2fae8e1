"""Bad input to ``mlm-convert reshard``: one clear line naming the file (and tensor), exit code 2,
and nothing at all written to ``--save`` (no directory, no temporary sibling)."""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.legacy.layout import DISTRIB_OPTIM_FILE, MODEL_FILE
from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tools.convert_cli import main

CFG = tiny_config(num_layers=4)
RANK = "iter_0000003/mp_rank_01_001"  # tp rank 1, pp rank 1 of a tp=2, pp=2 checkpoint
LN = "layers.1.input_layernorm.weight"  # local name on pp rank 1 (global layer 3)


class Arbitrary:
    """An arbitrary class: its pickle must be refused (and its code never run)."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("echo pwned > /dev/null",))


def _edit(root: Path, fn: Callable[[dict], None], rank: str = RANK) -> Path:
    path = root / rank / MODEL_FILE
    state = torch.load(path, weights_only=True)
    fn(state)
    torch.save(state, path)
    return path


def _missing_shard(root: Path) -> tuple[str, ...]:
    shutil.rmtree(root / RANK)
    return ("mp_rank_01_001", "missing shard")


def _truncated(root: Path) -> tuple[str, ...]:
    path = root / RANK / MODEL_FILE
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return (str(path), "cannot be read")


def _shape_mismatch(root: Path) -> tuple[str, ...]:
    def fn(state: dict) -> None:
        enc = state["model"]["language_model"]["encoder"]
        enc["layers.0.mlp.dense_h_to_4h.weight"] = enc["layers.0.mlp.dense_h_to_4h.weight"][:-1].clone()

    path = _edit(root, fn)
    return (str(path), "layers.0.mlp.dense_h_to_4h.weight", "layers.2.mlp.dense_h_to_4h.weight", "shape")


def _replicated_differ(root: Path) -> tuple[str, ...]:
    def fn(state: dict) -> None:
        state["model"]["language_model"]["encoder"][LN] += 1e-3

    path = _edit(root, fn)
    return (str(path), "layers.3.input_layernorm.weight", "replicated copies differ")


def _arbitrary_class(root: Path) -> tuple[str, ...]:
    def fn(state: dict) -> None:
        state["args"] = argparse.Namespace(evil=Arbitrary())

    path = _edit(root, fn)
    return (str(path), "unsafe checkpoint file", "posix.system")


CASES = {
    "missing shard": _missing_shard,
    "truncated file": _truncated,
    "shapes differ between shards": _shape_mismatch,
    "replicated tensors differ": _replicated_differ,
    "pickled arbitrary class": _arbitrary_class,
}


@pytest.fixture(scope="module")
def full() -> dict[str, torch.Tensor]:
    return full_weights(CFG)


def _reshard_fails(src: Path, save: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    argv = ["reshard", "--load", str(src), "--save", str(save), "--target-tp", "1", "--target-pp", "4"]
    with pytest.raises(SystemExit) as err:
        main([*argv, *extra])
    assert err.value.code == 2
    msg = capsys.readouterr().err.strip()
    assert not save.exists() and not list(save.parent.glob(f".{save.name}*")), list(save.parent.iterdir())
    return msg


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_clear_error_and_writes_nothing(
    tmp_path: Path, full, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_ours(tmp_path / "ck", CFG, full, tp=2, pp=2)
    assert main(["reshard", "--load", str(src), "--save", str(tmp_path / "ok"),
                 "--target-tp", "1", "--target-pp", "4"]) == 0  # fmt: skip
    expected = CASES[case](src)
    msg = _reshard_fails(src, tmp_path / "out", capsys)
    assert len(msg.splitlines()) == 1, msg
    for text in expected:
        assert text in msg, (text, msg)


def test_heads_not_divisible_by_target_tp(tmp_path: Path, full, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_ours(tmp_path / "ck", CFG, full, tp=2, pp=2)
    argv = [
        "reshard",
        "--load",
        str(src),
        "--save",
        str(tmp_path / "out"),
        "--target-tp",
        "3",
        "--target-pp",
        "1",
    ]
    with pytest.raises(SystemExit) as err:
        main(argv)
    msg = capsys.readouterr().err
    assert err.value.code == 2 and "8" in msg and "not divisible by --target-tp 3" in msg
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_corrupt_distributed_optimizer_shards(
    tmp_path: Path, full, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_ours(tmp_path / "ck", CFG, full, tp=2, pp=2)
    bad = src / "iter_0000003/mp_rank_00_000" / DISTRIB_OPTIM_FILE
    bad.write_bytes(b"not a checkpoint")
    msg = _reshard_fails(src, tmp_path / "out", capsys, "--with-optimizer")
    assert str(bad) in msg and "cannot be read" in msg
    torch.save({"shards": [{"dp_rank": 1, "dp_size": 2}]}, bad)  # DP rank 0's shard missing
    msg = _reshard_fails(src, tmp_path / "out", capsys, "--with-optimizer")
    assert str(bad) in msg and "DP ranks" in msg
